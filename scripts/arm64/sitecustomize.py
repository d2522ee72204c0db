"""Imported by the emulated aarch64 Python at start-up (run.sh puts this folder on PYTHONPATH):
lays the repository's packages out as an install does, without installing anything. The
repository's lever/ comes first on the path; LEVER_ARM64_PKG names a folder that run.sh fills
with links to stages/ and backends/ (lever.stages, lever.backends, as pyproject.toml maps them)
and the aarch64 liblever_kernels.so, and it joins lever's package path, as scikit-build-core's
editable install does on the host."""

import os

_extra = os.environ.get("LEVER_ARM64_PKG")
if _extra:
    import lever

    if _extra not in lever.__path__:
        lever.__path__.append(_extra)
