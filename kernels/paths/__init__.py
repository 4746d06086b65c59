"""One module per NVFP4 compute path (``reference``, ``exact``, ``fp8``, ``blackwell_fp4``), each exporting
``PATH``, a :class:`~.base.ComputePath`. :mod:`h3_turbo.kernels.registry` lists them; add one there."""
