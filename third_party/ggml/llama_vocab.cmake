# llama.cpp's tokenizer, compiled from the pinned sdist (never committed): kvflash::Tokenizer
# (csrc/kvflash/tokenizer.cpp) is llama.cpp's llama_vocab, loaded through its llama_model_loader
# from GGUF metadata alone.  These eight files are the whole closure of llama_vocab::load /
# tokenize / token_to_piece / detokenize (the loader's only other references, llama_split_path /
# llama_split_prefix from src/llama.cpp, are answered in tokenizer.cpp: kvflash never loads splits).
# libllama itself (llama-model.cpp, the context, 150+ model graphs) is not built.
#
#   -DKVFLASH_LLAMA_SOURCE=/path/to/llama.cpp (or env KVFLASH_LLAMA_SOURCE): a local tree holding
#   src/llama-vocab.cpp; otherwise the parent of a local KVFLASH_GGML_SOURCE when it is one, else the
#   sdist's vendor/llama.cpp (the same sha256-checked download as ggml).
#
# Defines kvflash-llama-vocab: a static, position-independent library with hidden symbols, so
# libkvflash exports none of llama.cpp's names (a process may load libllama beside it).
set(KVFLASH_LLAMA_SOURCE "$ENV{KVFLASH_LLAMA_SOURCE}" CACHE PATH "Local llama.cpp tree for the tokenizer (skips the sdist)")

function(kvflash_llama_source out_var ggml_src)
  if(KVFLASH_LLAMA_SOURCE)
    set(_src "${KVFLASH_LLAMA_SOURCE}")
  elseif(KVFLASH_GGML_SOURCE AND EXISTS "${ggml_src}/../src/llama-vocab.cpp")
    get_filename_component(_src "${ggml_src}/.." ABSOLUTE)
  else()
    find_package(Python COMPONENTS Interpreter REQUIRED)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" "${PROJECT_SOURCE_DIR}/python/kvflash/_registry.py"
              llama-src "${CMAKE_BINARY_DIR}/_llama"
      OUTPUT_VARIABLE _src OUTPUT_STRIP_TRAILING_WHITESPACE
      ERROR_VARIABLE _err RESULT_VARIABLE _rc)
    if(NOT _rc EQUAL 0)
      message(FATAL_ERROR "kvflash: could not obtain llama.cpp's tokenizer sources:\n${_err}\n"
                          "Offline? Pass -DKVFLASH_LLAMA_SOURCE=/path/to/llama.cpp.")
    endif()
  endif()
  if(NOT EXISTS "${_src}/src/llama-vocab.cpp" OR NOT EXISTS "${_src}/include/llama.h")
    message(FATAL_ERROR "kvflash: ${_src} is not a llama.cpp tree (no src/llama-vocab.cpp, include/llama.h)")
  endif()
  message(STATUS "kvflash: llama.cpp tokenizer from ${_src}")
  set(${out_var} "${_src}" PARENT_SCOPE)
endfunction()

kvflash_llama_source(_llama_src "${_ggml_src}")
set(_llama_files llama-vocab unicode unicode-data llama-model-loader llama-arch llama-mmap llama-impl llama-hparams)
list(TRANSFORM _llama_files PREPEND "${_llama_src}/src/")
list(TRANSFORM _llama_files APPEND ".cpp")
add_library(kvflash-llama-vocab STATIC ${_llama_files})
target_include_directories(kvflash-llama-vocab PUBLIC "${_llama_src}/include" "${_llama_src}/src")
target_link_libraries(kvflash-llama-vocab PUBLIC ggml ggml-base)
target_compile_features(kvflash-llama-vocab PRIVATE cxx_std_17)
set_target_properties(kvflash-llama-vocab PROPERTIES POSITION_INDEPENDENT_CODE ON
                      CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  target_compile_options(kvflash-llama-vocab PRIVATE -w)  # llama.cpp's code, built as it ships
endif()
