// Python module entry of the ahead-of-time build (`import sift._C`). The ops' schemas and fake
// kernels are defined in sift/_ops/; each source registers its CPU kernel (TORCH_LIBRARY_IMPL)
// and defines its `<op>_isa` query, so the same files also load through the JIT build. The C++
// checks guard memory when a kernel is called directly (torch.ops.sift.*); sift/_ops/'s
// entries name a bad argument the same way on every backend.
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "sift C++ ops (torch.ops.sift)", -1, nullptr};
  return PyModule_Create(&module_def);
}
