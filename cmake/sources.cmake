# The core's sources: the one list that every build of the core compiles (libkvflash, the
# sanitizer build, the fuzz targets in bench/fuzz), so none can fall behind when a file is added.
#   KVFLASH_PAGER_SOURCES  the pager's bookkeeping alone (no ggml, no Python): the pager-only builds
#   KVFLASH_CORE_SOURCES   everything in csrc/kvflash (the pager's, the loader, the runtime, the C API, ...)
#                          but attn_bench.cpp, the attention bench's harness, which the Python module
#                          compiles (KVFLASH_BINDING_SOURCES)
#   tokenizer.cpp is llama.cpp's vocabulary code behind checks: every target compiling the core links
#   kvflash-llama-vocab (third_party/ggml/llama_vocab.cmake, added with ggml)
# Paths are absolute, so any CMakeLists may include this file.
get_filename_component(_kvf_src "${CMAKE_CURRENT_LIST_DIR}/../csrc/kvflash" ABSOLUTE)
set(KVFLASH_PAGER_SOURCES ${_kvf_src}/pager.cpp ${_kvf_src}/host_store.cpp)
# One file per architecture family (arch_*.cpp), registered in arch.cpp.
file(GLOB _kvf_arch_sources CONFIGURE_DEPENDS ${_kvf_src}/arch_*.cpp)
set(KVFLASH_CORE_SOURCES
  ${KVFLASH_PAGER_SOURCES}
  ${_kvf_src}/pool.cpp
  ${_kvf_src}/memory.cpp
  ${_kvf_src}/device.cpp
  ${_kvf_src}/model_load.cpp
  ${_kvf_src}/arch.cpp
  ${_kvf_arch_sources}
  ${_kvf_src}/runtime.cpp
  ${_kvf_src}/scoring.cpp
  ${_kvf_src}/sampling.cpp
  ${_kvf_src}/attn_cpu.cpp
  ${_kvf_src}/attn_probs.cpp
  ${_kvf_src}/one_row_cpu.cpp
  ${_kvf_src}/rpc.cpp
  ${_kvf_src}/snapshot.cpp
  ${_kvf_src}/speculative.cpp
  ${_kvf_src}/session.cpp
  ${_kvf_src}/drafter.cpp
  ${_kvf_src}/session_file.cpp
  ${_kvf_src}/json.cpp
  ${_kvf_src}/tokenizer.cpp
  ${_kvf_src}/kvflash_c.cpp)
