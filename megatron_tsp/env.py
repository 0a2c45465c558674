"""What this machine offers TSP: library versions, optional accelerations, device, backend."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as metadata
import os
import platform
import warnings
from typing import Dict, Optional


def _version(dist_name: str) -> Optional[str]:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def transformer_engine_version() -> Optional[str]:
    """TransformerEngine's version when its PyTorch extension imports, else None (tried
    once a process: every model build and every result's record asks)."""
    try:
        te = importlib.import_module("transformer_engine.pytorch")
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return None
    return getattr(te, "__version__", None) or _version("transformer-engine") or "unknown"


def nvidia_apex_available() -> bool:
    """NVIDIA apex with its fused kernels (not the unrelated PyPI package named ``apex``)."""
    try:
        importlib.import_module("apex.normalization")
        importlib.import_module("fused_layer_norm_cuda")
    except Exception:  # noqa: BLE001
        return False
    return True


def device_and_backend() -> Dict[str, str]:
    """The device a rank launched here gets (:meth:`Device.from_launch`) and its collectives."""
    import torch

    from megatron_tsp.device import Device

    device = Device.from_launch(local_rank=0)
    if device.is_gpu:
        backend = "nccl" if device.vendor == "cuda" else "nccl (rccl)"
        return {"device": f"{device.vendor}: {torch.cuda.get_device_name(device.index)} x{torch.cuda.device_count()}",
                "backend": backend}
    return {"device": f"cpu: {platform.processor() or platform.machine()}", "backend": "gloo"}


def environment() -> Dict[str, object]:
    import torch

    info: Dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron-core": _version("megatron-core"),
        "megatron-tsp": _version("megatron-tsp"),
        "transformer-engine": transformer_engine_version(),
        "nvidia-apex": nvidia_apex_available(),
        # one value for every mode of a bench or gpu-check: their modes share processes
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
    }
    info.update(device_and_backend())
    return info


REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shown_path(path: str) -> str:
    """``path`` as a results file shows it: relative to the repository where it lies inside
    (committed results then name no machine's folders), else as given."""
    inside = os.path.relpath(os.path.abspath(path), REPOSITORY)
    return path if inside.startswith("..") else inside


def run_record(**extra) -> Dict[str, object]:
    """What a results file needs to say about where it was made: date, machine, commit,
    library versions, device (plus ``extra``; a ``config`` path as :func:`shown_path`)."""
    if "config" in extra:
        extra["config"] = shown_path(extra["config"])
    import datetime
    import os
    import subprocess

    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        commit = None
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), **extra,
            "machine": platform.platform(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "commit": commit, **environment()}


def quiet_import_noise() -> None:
    """Ignore the warnings megatron-core and torch print on import or for their own calls,
    nothing a user can change, in this process and the ranks it forks: every other warning
    (a kernel set aside, a slow fallback) still reaches the user. For the command line and
    the ranks' fork server, never on import of the package."""
    # TransformerEngine/apex missing: `megatron-tsp env` reports them; on a CPU they are not expected
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed")
    # megatron-core 0.16.1's own calls and defaults: torch's deprecated collectives, and
    # TransformerConfig's default cuda_graph_scope "full"
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                            "is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
    # megatron-core 0.19 imports absl.logging where it is installed, and says so where not;
    # it warns of its MIMO model's config class when the class is defined (on import)
    warnings.filterwarnings("ignore", message="absl.logging is not installed", category=UserWarning)
    warnings.filterwarnings("ignore", message="MimoModelConfig is experimental", category=UserWarning)
    # ... its advice for sequence parallelism, which `train` follows per mode (modes.Mode.device_max_connections)
    warnings.filterwarnings("ignore", message="When using sequence parallelism it is recommended to set the "
                            "environment variable CUDA_DEVICE_MAX_CONNECTIONS", category=UserWarning)
    # ... its optimizer asks every main parameter for .grad, the distributed optimizer's views too
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor",
                            category=UserWarning, module=r"megatron\.core\.optimizer")
    # ... its expert linear layers at expert tensor-parallel size 1 under sequence parallelism
    # (MoE under TSP and TP+SP here), where there is nothing to shard
    warnings.filterwarnings("ignore", message="`sequence_parallel` is set to `True`, but tensor model parallel size "
                            "is 1", category=UserWarning)
    # ... and its rank-0-only logging asks for a rank in the launcher, which has no process group
    warnings.filterwarnings("ignore", message="Could not determine rank from torch.distributed", category=UserWarning)
