// Python module entry of the ahead-of-time build (`import sift._C`). The ops are defined in
// sift/_ops.py; the other sources register their CPU kernels (TORCH_LIBRARY_IMPL blocks), so
// the same files also load through torch.ops.load_library / the JIT build.
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "sift C++ ops (torch.ops.sift)", -1, nullptr};
  return PyModule_Create(&module_def);
}
