"""The GPU a job runs on: with several visible, one claimed, so that parallel jobs never share one.

Launchers that run a sweep's jobs side by side on one machine start every job with the same GPUs
visible. submitit's local executor (`hydra/launcher=local_gpus`) sets CUDA_VISIBLE_DEVICES to
0..gpus_per_node-1 for every job, and starts every job at once (submitit/local/local.py,
`LocalExecutor._submit_command`); joblib's workers (`hydra/launcher=joblib`) inherit the parent's
GPUs. So a job with `device=auto` that sees several GPUs claims one: it takes an exclusive lock on
that GPU's lock file, waiting while every GPU is claimed, keeps it for the life of its process, and
narrows CUDA_VISIBLE_DEVICES to that GPU before CUDA starts: the job then sees exactly one GPU. The
lock is released when the process ends, however it ends.

The lock files are per user and machine (per allocation under SLURM) in the temporary folder, so
that the jobs of two sweeps, and runs started by hand, take turns on the GPUs too. A job that sees
one GPU (a SLURM job with one GPU, or `device=cuda:N`) claims nothing.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from longflow.models import resolve_device

WAIT_SECONDS = 10.0  # between two looks for a free GPU while every one is claimed

logger = logging.getLogger(__name__)

# This process's claim (gpu: the CUDA_VISIBLE_DEVICES entry, device, lock: the open lock file). It
# lives as long as the process: a launcher's worker may run several jobs, and a closed lock file
# would free the GPU while the process still uses it.
_claim: dict[str, Any] = {}


def visible_gpus() -> list[str]:
    """This process's GPUs as CUDA_VISIBLE_DEVICES entries (indices or UUIDs), or "0".."n-1" when
    it is unset; [] without CUDA. Counted through NVML: CUDA is not started."""
    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [entry.strip() for entry in listed.split(",")] if listed is not None else map(str, range(count))
    return list(entries)[:count]


def lock_dir() -> Path:
    """The folder of GPU lock files: per user and machine, or per SLURM allocation."""
    scope = os.environ.get("SLURM_JOB_ID")
    name = f"longflow-gpus-{os.getuid()}" + (f"-slurm{scope}" if scope else "")
    return Path(tempfile.gettempdir()) / name


def claim_gpu(gpus: list[str], folder: Path, wait_seconds: float = WAIT_SECONDS) -> str:
    """Locks the first free one of `gpus` (CUDA_VISIBLE_DEVICES entries) for the rest of this process,
    waiting while every one is locked by another; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    waiting = False
    while True:
        for gpu in gpus:
            handle = open(folder / f"gpu-{re.sub(r'[^A-Za-z0-9-]', '_', gpu)}.lock", "a")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            _claim.update(gpu=gpu, lock=handle)
            return gpu
        if not waiting:
            logger.info("every visible GPU (%s) is claimed by another job; waiting for one", ",".join(gpus))
            waiting = True
        time.sleep(wait_seconds)


def job_device(device: str) -> torch.device:
    """The torch device of a run's config value `device`. With "auto" and several GPUs visible, the
    GPU this process claims (`claim_gpu`), made the only one visible; otherwise
    `longflow.models.resolve_device`. Call it before anything starts CUDA in this process."""
    if device != "auto":
        return resolve_device(device)
    if "device" in _claim:
        return _claim["device"]
    gpus = visible_gpus()
    if len(gpus) < 2:
        return resolve_device(device)
    gpu = claim_gpu(gpus, lock_dir())
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    torch.cuda.init()
    if torch.cuda.device_count() == 1:
        _claim["device"] = torch.device("cuda", 0)
    else:
        # CUDA had started in this process before the claim (Hydra's basic launcher runs the jobs in
        # the process that checked every config of the sweep), so the old numbering holds: use the
        # claimed GPU by its index, and leave CUDA_VISIBLE_DEVICES saying what CUDA sees.
        if listed is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = listed
        _claim["device"] = torch.device("cuda", gpus.index(gpu))
    logger.info("claimed GPU %s (%s)", gpu, _claim["device"])
    return _claim["device"]


def device_record(device: torch.device) -> dict[str, Any]:
    """Where a run generated, for provenance.json: the device's name, its torch index and UUID,
    CUDA_VISIBLE_DEVICES, and the GPU claimed from several (None when none was)."""
    record = {"name": "cpu", "index": None, "uuid": None,
              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "claimed": _claim.get("gpu")}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        record.update(name=properties.name, index=index, uuid=str(getattr(properties, "uuid", None)))
    return record
