// The entry point of one ISA level's extension module, tokenmill.kernels._C_<level>: compiled once
// per level (kernels/build.py defines TM_ISA_LEVEL), it hands over to bindings.cpp's module _C, so
// that the bindings (the costly unit to compile) are compiled once for every level.
#include <Python.h>

#define TM_STR2(x) #x
#define TM_STR(x) TM_STR2(x)
#define TM_CAT2(a, b) a##b
#define TM_CAT(a, b) TM_CAT2(a, b)

extern "C" PyObject* PyInit__C();

extern "C" __attribute__((visibility("default"))) PyObject* TM_CAT(PyInit__C_, TM_ISA_LEVEL)() { return PyInit__C(); }

const char* tm_isa_level() { return TM_STR(TM_ISA_LEVEL); }
