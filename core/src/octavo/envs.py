"""Every environment variable Octavo reads, declared in this one place.

| variable | meaning |
|---|---|
| ``OCTAVO_LOG_LEVEL`` | level of the ``octavo`` logger (DEBUG, INFO, WARNING, ...; NOTSET = leave logging alone) |
| ``OCTAVO_PLUGINS`` | comma-separated allow-list of entry-point names to load (unset = all; empty = none) |
| ``OCTAVO_DISABLE_PLUGINS`` | comma-separated entry-point names never to load |
| ``OCTAVO_TRACE_HOOKS`` | ``1`` logs every hook call and its result at DEBUG level on ``octavo.hooks`` |
| ``OCTAVO_CPU_KVCACHE_SPACE`` | KV-cache size in GiB on the CPU backend when ``--cpu-kv-cache-space`` is not given (default 4) |
| ``OCTAVO_CPU_GGUF_KERNELS`` | ``0`` keeps the CPU backend's C++ GGUF kernels from the ``gguf`` quantization method (its torch path runs; default ``1``); ``--quantization none`` dequantizes a GGUF file while loading |
| ``OCTAVO_API_KEY`` | the API key of ``octavo serve`` when ``--api-key`` is not given (kept out of ``ps``) |
| ``OCTAVO_GRAMMAR_ACCEPT`` | how the grammar thread advances the matchers of a step's constrained rows: ``parallel`` (default: llguidance's ``consume_token_par``, the GIL released; measured best on the H100) or ``loop`` (one ``consume_token`` after the other, holding the GIL) |
| ``OCTAVO_GRAMMAR_SWITCH_INTERVAL_US`` | the GIL switch interval (``sys.setswitchinterval``) while the grammar thread works beside the engine thread, in µs (default 200; ``0`` leaves Python's 5,000 alone) |
| ``OCTAVO_SKINNY_CONFIG_TABLES`` | ``0`` ignores the per-GPU launch-config tables of the small-M Triton kernels (``octavo.kernels.triton.skinny_gemm``): configs are then timed at start-up (default ``1``) |
| ``OCTAVO_SKINNY_CONFIG_DIR`` | a folder of ``skinny_<GPU name>.json`` launch-config tables for the small-M Triton kernels, read instead of the package's own (``octavo/kernels/triton/configs``; as vLLM's ``VLLM_TUNED_CONFIG_FOLDER``; for A/B runs of a freshly swept table) |
| ``OCTAVO_SKINNY_IN_KERNEL_SUM`` | ``0``: split-K launches of the small-M Triton kernels add into a zeroed float32 output and cast it after, instead of summing in the kernel through a per-device workspace (read once per process; default ``1``; for A/B runs) |
| ``OCTAVO_ARGMAX_KERNEL`` | ``0``: greedy sampling of up to 16 rows on NVIDIA GPUs takes torch's argmax instead of the two-kernel Triton argmax (``octavo.kernels.argmax``; read once per process; default ``1``; for A/B runs) |
| ``OCTAVO_PDL`` | ``0``: the decode step's Triton kernels launch in plain stream order instead of with programmatic dependent launch on compute capability 9.0+ (``octavo.kernels.triton.pdl``; read once per process; default ``1``) |
| ``OCTAVO_ROTARY_CACHE_WRITE`` | ``0``: the Triton attention backend rotates the keys, then writes the cache, in two kernels instead of one (``apply_rotary_write_kv``; read when a layer's kernels are made; default ``1``) |
| ``OCTAVO_SKINNY_PDL`` | ``0``: ``fp8_gemv`` and ``int4_gemv`` at one row launch in plain stream order instead of with PDL, loading their first step's weights before they wait (``octavo.kernels.triton.pdl``; read once per process; default ``1``) |
| ``OCTAVO_CUDA_INT4_PANELS`` | ``0``: int4 layers the CUDA backend's tensor-core GEMV takes keep GPTQ's ``[K / 8, N]`` words instead of being rearranged into 32-output panels at load (``octavo_cuda.quant``; read when a model loads; default ``1``; for A/B runs) |
| ``OCTAVO_CUDA_INT4_NORM`` | ``1``: at one row the CUDA backend's tensor-core int4 GEMV after an RMS norm (qkv, gate_up) computes the norm itself, one kernel less per norm (``octavo_cuda.int4_mma.int4_mma_gemv_add_rms_norm`` through ``LinearMethod.apply_add_rms_norm``; read when a model is built; default ``1``; ``0`` for A/B runs) |
| ``OCTAVO_CUDA_INT4_MMA`` | ``0``: int4 (GPTQ/AWQ) layers at 1 to 8 rows on NVIDIA GPUs run the Triton ``int4_gemv`` instead of the CUDA backend's tensor-core GEMV (``octavo_cuda.int4_mma``, compiled with NVRTC; read when a model is built; default ``1``; for A/B runs) |
| ``OCTAVO_DENSE_GEMV`` | ``0``: dense (unquantized) linear layers at one row run ``F.linear`` (cuBLAS) instead of the Triton one-row GEMV that reads its weights before it waits for the kernel before it (``octavo.kernels.dense``; compute capability 9.0+ with PDL on; read once per process; default ``1``) |
| ``OCTAVO_CPU_PIN_STEPS`` | ``0`` leaves the CPU backend's calling thread unpinned during steps (``octavo_cpu.threads``; default ``1``: pinned to its core while a step computes) |
| ``OCTAVO_CPU_ATTENTION_HEAD_TILES`` | ``0`` turns off the CPU decode attention's head tiles (all KV heads of a sequence in one tile; read by the C++ kernels once per process; default ``1``) |
| ``OCTAVO_GC_THRESHOLD`` | the cyclic garbage collector's thresholds (``gc.set_threshold``) in the processes the engine owns (the API server, the engine core, ``octavo bench``), three comma-separated integers (default ``50000,20,100``; ``700,10,10`` is Python's own; ``octavo.engine_core.gc_heap``) |
| ``OCTAVO_ALLOW_RUNTIME_LORA_UPDATING`` | ``1`` adds ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` to ``octavo serve`` (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) |
"""

import os


def log_level() -> str:
    return os.environ.get("OCTAVO_LOG_LEVEL", "INFO").upper()


def plugin_allow_list() -> set[str] | None:
    """Entry-point names allowed to load, or ``None`` when every installed plugin may load."""
    raw = os.environ.get("OCTAVO_PLUGINS")
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def plugin_block_list() -> set[str]:
    raw = os.environ.get("OCTAVO_DISABLE_PLUGINS", "")
    return {name.strip() for name in raw.split(",") if name.strip()}


def trace_hooks() -> bool:
    return os.environ.get("OCTAVO_TRACE_HOOKS", "0") not in ("", "0", "false", "False")


def api_key() -> str | None:
    """The server's API key from the environment (``None`` when unset or empty)."""
    return os.environ.get("OCTAVO_API_KEY") or None


def cpu_kvcache_space() -> float | None:
    """``OCTAVO_CPU_KVCACHE_SPACE``: the CPU backend's KV-cache size in GiB (``None`` when
    unset or empty); ``ValueError`` unless it is a number > 0."""
    raw = os.environ.get("OCTAVO_CPU_KVCACHE_SPACE", "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"OCTAVO_CPU_KVCACHE_SPACE must be a size in GiB > 0, got {raw!r}")
    return value


def cpu_gguf_kernels() -> bool:
    """``OCTAVO_CPU_GGUF_KERNELS``: whether the CPU backend gives the ``gguf`` quantization
    method its C++ kernels (default yes; ``0``/``false``: the method's torch path runs)."""
    return os.environ.get("OCTAVO_CPU_GGUF_KERNELS", "1").strip() not in ("0", "false", "False")


def cuda_int4_mma() -> bool:
    """``OCTAVO_CUDA_INT4_MMA``: whether the CUDA backend gives the ``gptq`` and ``awq``
    methods its tensor-core GEMV for 1 to 8 rows (``octavo_cuda.int4_mma``; default yes;
    ``0``/``false``: the Triton ``int4_gemv`` runs; read when a model is built)."""
    return os.environ.get("OCTAVO_CUDA_INT4_MMA", "1").strip() not in ("0", "false", "False")


def cuda_int4_norm() -> bool:
    """``OCTAVO_CUDA_INT4_NORM``: whether the CUDA backend's int4 kernels take the RMS norm
    before a one-row GEMV into it (``octavo_cuda.quant``; default yes; ``0``/``false``: no,
    for A/B runs; read when a model is built)."""
    return os.environ.get("OCTAVO_CUDA_INT4_NORM", "1").strip() not in ("0", "false", "False")


def cuda_int4_panels() -> bool:
    """``OCTAVO_CUDA_INT4_PANELS``: whether the CUDA backend rearranges the int4 words of the
    layers its tensor-core GEMV takes into 32-output panels at load (``octavo_cuda.quant``;
    default yes; ``0``/``false``: GPTQ's layout is kept; read when a model loads)."""
    return os.environ.get("OCTAVO_CUDA_INT4_PANELS", "1").strip() not in ("0", "false", "False")


def cpu_layer_kernels() -> bool:
    """``OCTAVO_CPU_LAYER_KERNELS``: whether the CPU backend gives the model layers its C++
    RMSNorm, rotary and SiLU-and-mul ops (``octavo.kernels.host_layer_kernels``; default yes;
    ``0``/``false``: the layers' torch code runs)."""
    return os.environ.get("OCTAVO_CPU_LAYER_KERNELS", "1").strip() not in ("0", "false", "False")


def allow_runtime_lora_updating() -> bool:
    """``OCTAVO_ALLOW_RUNTIME_LORA_UPDATING``: whether the server may load and unload LoRA
    adapters while it runs (default no; ``1``/``true``: the two endpoints exist)."""
    return os.environ.get("OCTAVO_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in (
        "1", "true", "yes")


def cpu_fused_layers() -> bool:
    """``OCTAVO_CPU_FUSED_LAYERS``: whether the CPU backend runs each eligible decoder layer
    (GGUF weights on its C++ kernels) as one C++ call (``octavo_cpu.fused_layer``; default
    yes; ``0``/``false``: the layers' Python forward runs)."""
    return os.environ.get("OCTAVO_CPU_FUSED_LAYERS", "1").strip() not in ("0", "false", "False")


def gc_threshold() -> tuple[int, int, int]:
    """``OCTAVO_GC_THRESHOLD``: ``gc.set_threshold``'s three integers for the processes the
    engine owns (default ``50000,20,100``; ``octavo.engine_core.gc_heap``)."""
    raw = os.environ.get("OCTAVO_GC_THRESHOLD", "50000,20,100")
    try:
        values = tuple(int(part) for part in raw.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or values[0] < 1 or min(values) < 0:
        raise ValueError(f"OCTAVO_GC_THRESHOLD must be three comma-separated integers (the "
                         f"first >= 1), e.g. 700,10,10 for Python's own; got {raw!r}")
    return values


def grammar_accept() -> str:
    """``OCTAVO_GRAMMAR_ACCEPT``: ``parallel`` (default) or ``loop``, how the grammar thread
    advances a step's matchers (``octavo.structured_output.manager``)."""
    raw = os.environ.get("OCTAVO_GRAMMAR_ACCEPT", "parallel").strip().lower()
    if raw not in ("parallel", "loop"):
        raise ValueError(f"OCTAVO_GRAMMAR_ACCEPT must be 'parallel' or 'loop', got {raw!r}")
    return raw


def grammar_process() -> bool | None:
    """``OCTAVO_GRAMMAR_PROCESS``: where the engine core's grammars run
    (``octavo.structured_output.process``): ``1`` in a process of their own, ``0`` on the
    engine core's threads, ``auto`` (default, ``None`` here) in their own process under async
    scheduling, where a constrained step's grammar work runs beside the engine thread."""
    raw = os.environ.get("OCTAVO_GRAMMAR_PROCESS", "auto").strip().lower()
    if raw not in ("0", "1", "auto"):
        raise ValueError(f"OCTAVO_GRAMMAR_PROCESS must be 0, 1 or auto, got {raw!r}")
    return None if raw == "auto" else raw == "1"


def grammar_switch_interval_s() -> float | None:
    """``OCTAVO_GRAMMAR_SWITCH_INTERVAL_US``: the GIL switch interval in seconds while the
    grammar thread works beside the engine thread (default 200 µs); ``None`` for ``0``
    (Python's own interval is left alone)."""
    raw = os.environ.get("OCTAVO_GRAMMAR_SWITCH_INTERVAL_US", "200").strip()
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"OCTAVO_GRAMMAR_SWITCH_INTERVAL_US must be a number of µs >= 0, "
                         f"got {raw!r}")
    return value * 1e-6 if value > 0 else None


def grammar_spin_s() -> float:
    """``OCTAVO_GRAMMAR_SPIN_US``: how long the grammar process and the engine core poll their
    pipe without sleeping, in seconds, when the other end's next message is due: the child
    after answering a step (the next comes within a step's time), the engine core while it
    waits for a step's answer (default 3000 µs on a machine of 8 cores or more, else ``0``:
    always sleep until woken, leaving a small machine's cores to the engine). A sleeping
    process pays the scheduler's wake-up on each message, twice per constrained step."""
    return _spin_s("OCTAVO_GRAMMAR_SPIN_US")


def worker_spin_s() -> float:
    """``OCTAVO_WORKER_SPIN_US``: how long the worker processes of the ``mp`` executor and the
    engine core poll their sockets without sleeping, in seconds, after a message, when the
    other end's next one is due: a worker after handling a message (the next step or sample
    comes within a step's time), the engine core while it waits for a step's results (default
    3000 µs on a machine of 8 cores or more, else ``0``). A sleeping process pays the
    scheduler's wake-up on each message, twice per step on the chain from a step's sampled
    tokens to the next sampling."""
    return _spin_s("OCTAVO_WORKER_SPIN_US")


def _spin_s(name: str) -> float:
    """A spin window in seconds from ``name`` (µs; default 3000 on 8+ cores, else 0)."""
    default = "3000" if (os.cpu_count() or 1) >= 8 else "0"
    raw = os.environ.get(name, default).strip()
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"{name} must be a number of µs >= 0, got {raw!r}")
    return value * 1e-6


def grammar_threads() -> int:
    """``OCTAVO_GRAMMAR_THREADS``: the threads of llguidance's pool that fill a step's masks
    and advance its matchers (default half the machine's cores, 1 to 8)."""
    default = max(1, min(8, (os.cpu_count() or 2) // 2))
    raw = os.environ.get("OCTAVO_GRAMMAR_THREADS", "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"OCTAVO_GRAMMAR_THREADS must be a whole number >= 1, got {raw!r}")
    return value


def grammar_cpus() -> set[int] | None:
    """``OCTAVO_GRAMMAR_CPUS``: the CPUs the grammar process and its threads run on (a list
    as ``taskset -c`` takes it: ``8-15`` or ``2,4,6-7``; default unset: wherever the
    scheduler puts them), so that they can be kept off the engine core's CPUs; for
    experiments on hosts where their placement changes the constrained throughput."""
    raw = os.environ.get("OCTAVO_GRAMMAR_CPUS", "").strip()
    if not raw:
        return None
    cpus: set[int] = set()
    try:
        for part in raw.split(","):
            first, dash, last = part.strip().partition("-")
            low, high = int(first), int(last if dash else first)
            if low < 0 or high < low:
                raise ValueError(part)
            cpus.update(range(low, high + 1))
    except ValueError:
        raise ValueError(f"OCTAVO_GRAMMAR_CPUS must be a CPU list such as 8-15 or 2,4,6-7, "
                         f"got {raw!r}") from None
    return cpus


def prepare_ahead() -> bool:
    """``OCTAVO_PREPARE_AHEAD``: whether, under async scheduling with structured outputs, the
    engine core prepares a step (its requests' state and inputs) while the grammar work of the
    step before finishes, instead of after that step's sampling is launched (default yes;
    ``0``/``false``: after; for A/B runs)."""
    return os.environ.get("OCTAVO_PREPARE_AHEAD", "1").strip() not in ("0", "false", "False")


def skinny_config_tables() -> bool:
    """``OCTAVO_SKINNY_CONFIG_TABLES``: whether the small-M Triton kernels take their launch
    configs from the GPU's table when it has one (default yes; ``0``/``false``: timed)."""
    return os.environ.get("OCTAVO_SKINNY_CONFIG_TABLES", "1").strip() not in ("0", "false",
                                                                               "False")


def skinny_config_dir() -> str | None:
    """``OCTAVO_SKINNY_CONFIG_DIR``: a folder of config tables read instead of the package's
    (``None``: unset or empty)."""
    return os.environ.get("OCTAVO_SKINNY_CONFIG_DIR", "").strip() or None


def skinny_pdl() -> bool:
    """``OCTAVO_SKINNY_PDL``: whether ``fp8_gemv`` and ``int4_gemv`` at one row launch with
    programmatic dependent launch where the other decode kernels do, loading their first
    step's weights before they wait (default yes; ``0``/``false``: plain stream order;
    ``octavo.kernels.triton.pdl``; read once per process; for A/B runs)."""
    return os.environ.get("OCTAVO_SKINNY_PDL", "1").strip() not in ("0", "false", "False")


def skinny_in_kernel_sum() -> bool:
    """``OCTAVO_SKINNY_IN_KERNEL_SUM``: whether split-K launches of the small-M Triton kernels
    sum their parts in the kernel through a per-device workspace (default yes; ``0``/``false``:
    a zeroed float32 output and a cast after, three kernels per call; read once per process;
    for A/B runs)."""
    return os.environ.get("OCTAVO_SKINNY_IN_KERNEL_SUM", "1").strip() not in ("0", "false",
                                                                               "False")


def pdl() -> bool:
    """``OCTAVO_PDL``: whether the decode step's Triton kernels launch with programmatic
    dependent launch on GPUs that have it (compute capability 9.0+; default yes;
    ``0``/``false``: plain stream order; ``octavo.kernels.triton.pdl``)."""
    return os.environ.get("OCTAVO_PDL", "1").strip() not in ("0", "false", "False")


def rotary_cache_write() -> bool:
    """``OCTAVO_ROTARY_CACHE_WRITE``: whether the Triton attention backend rotates the keys
    straight into the KV cache in the rotary kernel (default yes; ``0``/``false``: the rotary
    kernel, then the cache-write kernel; read when a layer's kernels are made; for A/B runs)."""
    return os.environ.get("OCTAVO_ROTARY_CACHE_WRITE", "1").strip() not in ("0", "false",
                                                                             "False")


def dense_gemv() -> bool:
    """``OCTAVO_DENSE_GEMV``: whether dense linear layers at one row use the Triton one-row
    GEMV where it is on (CUDA compute capability 9.0+ with PDL; default yes; ``0``/``false``:
    ``F.linear``; ``octavo.kernels.dense``; for A/B runs)."""
    return os.environ.get("OCTAVO_DENSE_GEMV", "1").strip() not in ("0", "false", "False")


def argmax_kernel() -> bool:
    """``OCTAVO_ARGMAX_KERNEL``: whether greedy sampling of up to 16 rows on NVIDIA GPUs takes
    its argmax from the two-kernel Triton argmax (default yes; ``0``/``false``: torch's;
    ``octavo.kernels.argmax``; read once per process; for A/B runs)."""
    return os.environ.get("OCTAVO_ARGMAX_KERNEL", "1").strip() not in ("0", "false", "False")


def bitmask_kernel() -> bool:
    """``OCTAVO_BITMASK_KERNEL``: whether grammar bitmasks are applied to the logits on CUDA
    (and HIP) by one Triton kernel (default yes; ``0``/``false``: the torch ops;
    ``octavo.sample.sampler.mask_by_bitmask``; read once per process; for A/B runs)."""
    return os.environ.get("OCTAVO_BITMASK_KERNEL", "1").strip() not in ("0", "false", "False")


def cpu_pin_steps() -> bool:
    """``OCTAVO_CPU_PIN_STEPS``: whether the CPU worker pins the calling thread to its core
    while a step computes (default yes; ``0``/``false``: left alone)."""
    return os.environ.get("OCTAVO_CPU_PIN_STEPS", "1").strip() not in ("0", "false", "False")
