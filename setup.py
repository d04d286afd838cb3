"""The CPU kernel library (src/muser/engine/kernels/cpu.c), built with the system C compiler by
`pip install .` / `pip install -e .`; loaded through ctypes by muser.engine.kernels.cpu_native.
Portable flags only: the ISA is chosen at run time (target_clones), and -ffp-contract=off keeps
every product and sum a separate rounding whatever the ISA (results must not depend on it)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "muser.engine.kernels._cpu",
    sources=["src/muser/engine/kernels/cpu.c"],
    extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno",
                        "-pthread", "-Wno-psabi"],
    extra_link_args=["-pthread", "-Wno-psabi"],
)])
