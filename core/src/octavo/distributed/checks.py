"""Whether a model can be split as asked, checked before anything is loaded.

Each problem is one ``ValueError`` line that says what to change (``--tensor-parallel-size``,
``--pipeline-parallel-size``, the executor): a split that cannot work must fail at start-up,
not inside a worker after minutes of loading.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from octavo.config import EngineConfig


def check_parallel_config(config: EngineConfig, device_type: str) -> None:
    """Raise ``ValueError`` naming the problem when ``config``'s split cannot work.

    :param device_type: the backend's torch device type ("cuda" GPUs are counted).
    """
    parallel = config.parallel_config
    model = config.model_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if tp > 1:
        if model.num_heads % tp:
            raise ValueError(
                f"the model has {model.num_heads} attention heads, which do not split over "
                f"--tensor-parallel-size {tp}: use a size that divides {model.num_heads}")
        kv = model.num_kv_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ValueError(
                f"the model has {kv} KV heads: --tensor-parallel-size {tp} must divide them, or "
                f"be a multiple of them (each head then replicated on {tp // kv or 1} ranks)")
    if pp > model.num_layers:
        raise ValueError(
            f"the model has {model.num_layers} layers, fewer than --pipeline-parallel-size {pp}")
    if device_type == "cuda" and parallel.distributed_executor_backend in ("uni", "mp"):
        import torch

        visible = torch.cuda.device_count()
        if parallel.world_size > visible:
            raise ValueError(
                f"--tensor-parallel-size {tp} x --pipeline-parallel-size {pp} needs "
                f"{parallel.world_size} GPUs on this host, but {visible} are visible: lower "
                "the sizes, or use --distributed-executor-backend ray across hosts")
