"""The engine's C++ CPU kernels: their sources (csrc/), the ISA levels they are compiled for
(isa.py) and their build (build.py). cpu_kernels.py (model/layers) loads the level this CPU runs."""
