# ggml is never committed: kvflash_ggml_source(OUT) obtains the pinned source tree
# and sets OUT to its path (the directory holding include/ggml.h).
#
#   -DKVFLASH_GGML_SOURCE=/path/to/ggml  (or env KVFLASH_GGML_SOURCE) uses a local
#   checkout, for offline builds.  Otherwise the pinned llama-cpp-python sdist is
#   fetched through pip (its configured index), sha256-checked, cached in the
#   user cache, and its vendor/llama.cpp/ggml unpacked into the build tree.
#
# Used by third_party/ggml/CMakeLists.txt (the real build) and by the top-level
# KVFLASH_CUDA_COMPILE_ONLY check (headers only: nothing of ggml is configured or built).

set(KVFLASH_GGML_SOURCE "$ENV{KVFLASH_GGML_SOURCE}" CACHE PATH "Local ggml source tree (skips the registry fetch)")

function(kvflash_ggml_source out_var)
  if(KVFLASH_GGML_SOURCE)
    set(_ggml_src "${KVFLASH_GGML_SOURCE}")
  else()
    find_package(Python COMPONENTS Interpreter REQUIRED)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" "${PROJECT_SOURCE_DIR}/python/kvflash/_registry.py"
              ggml-sdist "${CMAKE_BINARY_DIR}/_ggml"
      OUTPUT_VARIABLE _ggml_src OUTPUT_STRIP_TRAILING_WHITESPACE
      ERROR_VARIABLE _ggml_err
      RESULT_VARIABLE _ggml_rc)
    if(NOT _ggml_rc EQUAL 0)
      message(FATAL_ERROR "kvflash: could not obtain the pinned ggml source:\n${_ggml_err}\n"
                          "Offline? Pass -DKVFLASH_GGML_SOURCE=/path/to/ggml (a ggml 0.25.x tree).")
    endif()
  endif()
  if(NOT EXISTS "${_ggml_src}/include/ggml.h")
    message(FATAL_ERROR "kvflash: ${_ggml_src} is not a ggml source tree (no include/ggml.h)")
  endif()
  message(STATUS "kvflash: ggml from ${_ggml_src}")
  set(${out_var} "${_ggml_src}" PARENT_SCOPE)
  # Which llama.cpp commit that is, for build_info (ggml's own CMake asks git in its source dir, which
  # inside our build tree is kvflash's checkout): the pin's, or "local" for a tree of the caller's.
  if(KVFLASH_GGML_SOURCE)
    set(KVFLASH_GGML_COMMIT "local:${KVFLASH_GGML_SOURCE}" PARENT_SCOPE)
  else()
    execute_process(
      COMMAND "${Python_EXECUTABLE}" "${PROJECT_SOURCE_DIR}/python/kvflash/_registry.py" ggml-commit
      OUTPUT_VARIABLE _ggml_commit OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
    set(KVFLASH_GGML_COMMIT "${_ggml_commit}" PARENT_SCOPE)
  endif()
endfunction()
