// Python module entry of the ahead-of-time build (`import sift._C`). The ops themselves are
// registered into torch.ops.sift by TORCH_LIBRARY_FRAGMENT blocks in the other sources, so
// the same files also load through torch.ops.load_library / the JIT build.
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "sift C++ ops (torch.ops.sift)", -1, nullptr};
  return PyModule_Create(&module_def);
}
