"""Multi-LoRA serving: PEFT adapters read and checked (``peft``), batched LoRA in the linear
layers (``layers``, the Triton kernels in ``octavo.kernels.triton.lora``) and the device slots
they live in (``manager``)."""
