"""``ndparallel plan --calibrate``: measure this machine (kernels, collectives) into a hardware profile."""
