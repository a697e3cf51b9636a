// _core.gguf_metadata: a GGUF file's key/value metadata through ggml's own reader
// (the one Model::load uses), as plain Python values.
#include <stdexcept>

#include "bindings.h"
#include "gguf.h"

namespace kvflash::bindings {

namespace {

// GGUF strings are bytes; undecodable ones survive as surrogates, as os.fsdecode does.
py::str gguf_str(const char *s) {
    PyObject *o = PyUnicode_DecodeUTF8(s, Py_ssize_t(std::strlen(s)), "surrogateescape");
    if (!o) throw py::error_already_set();
    return py::reinterpret_steal<py::str>(o);
}

template <class T> py::object numeric_list(const void *data, size_t n) {
    return py::array_t<T>(py::ssize_t(n), static_cast<const T *>(data)).attr("tolist")();
}

py::object array_value(const gguf_context *g, int64_t id) {
    const size_t n = gguf_get_arr_n(g, id);
    const enum gguf_type t = gguf_get_arr_type(g, id);
    if (t == GGUF_TYPE_STRING) {
        py::list out(n);
        for (size_t i = 0; i < n; ++i) out[i] = gguf_str(gguf_get_arr_str(g, id, i));
        return out;
    }
    const void *d = gguf_get_arr_data(g, id);
    switch (t) {
        case GGUF_TYPE_UINT8: return numeric_list<uint8_t>(d, n);
        case GGUF_TYPE_INT8: return numeric_list<int8_t>(d, n);
        case GGUF_TYPE_UINT16: return numeric_list<uint16_t>(d, n);
        case GGUF_TYPE_INT16: return numeric_list<int16_t>(d, n);
        case GGUF_TYPE_UINT32: return numeric_list<uint32_t>(d, n);
        case GGUF_TYPE_INT32: return numeric_list<int32_t>(d, n);
        case GGUF_TYPE_FLOAT32: return numeric_list<float>(d, n);
        case GGUF_TYPE_BOOL: return numeric_list<bool>(d, n);
        case GGUF_TYPE_UINT64: return numeric_list<uint64_t>(d, n);
        case GGUF_TYPE_INT64: return numeric_list<int64_t>(d, n);
        case GGUF_TYPE_FLOAT64: return numeric_list<double>(d, n);
        default: throw std::invalid_argument(std::string("GGUF array of ") + gguf_type_name(t) + " is not supported");
    }
}

py::object value(const gguf_context *g, int64_t id) {
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8: return py::int_(gguf_get_val_u8(g, id));
        case GGUF_TYPE_INT8: return py::int_(gguf_get_val_i8(g, id));
        case GGUF_TYPE_UINT16: return py::int_(gguf_get_val_u16(g, id));
        case GGUF_TYPE_INT16: return py::int_(gguf_get_val_i16(g, id));
        case GGUF_TYPE_UINT32: return py::int_(gguf_get_val_u32(g, id));
        case GGUF_TYPE_INT32: return py::int_(gguf_get_val_i32(g, id));
        case GGUF_TYPE_UINT64: return py::int_(gguf_get_val_u64(g, id));
        case GGUF_TYPE_INT64: return py::int_(gguf_get_val_i64(g, id));
        case GGUF_TYPE_FLOAT32: return py::float_(gguf_get_val_f32(g, id));
        case GGUF_TYPE_FLOAT64: return py::float_(gguf_get_val_f64(g, id));
        case GGUF_TYPE_BOOL: return py::bool_(gguf_get_val_bool(g, id));
        case GGUF_TYPE_STRING: return gguf_str(gguf_get_val_str(g, id));
        case GGUF_TYPE_ARRAY: return array_value(g, id);
        default: throw std::invalid_argument("unknown GGUF value type");
    }
}

}  // namespace

void bind_gguf(py::module_ &m) {
    m.def("gguf_metadata", [](const std::string &path, py::object prefix) {
        const std::string pre = optional_path(prefix);
        gguf_init_params params{true, nullptr};  // metadata only: no tensor context, no data read
        gguf_context *g = gguf_init_from_file(path.c_str(), params);
        if (!g) throw std::invalid_argument(path + ": truncated or corrupt GGUF header (ggml's reader refused it)");
        std::unique_ptr<gguf_context, void (*)(gguf_context *)> own(g, gguf_free);
        py::dict out;
        for (int64_t id = 0; id < gguf_get_n_kv(g); ++id) {
            const char *key = gguf_get_key(g, id);
            if (std::strncmp(key, pre.c_str(), pre.size()) != 0) continue;
            try {
                out[gguf_str(key)] = value(g, id);
            } catch (const std::invalid_argument &e) {
                throw std::invalid_argument(path + ": metadata key '" + key + "': " + e.what());
            }
        }
        return out;
    }, py::arg("path"), py::arg("prefix") = py::none(),
       "Key/value metadata of a GGUF file as Python values (arrays as lists), read by ggml's gguf reader; only keys "
       "starting with prefix when given.  ValueError for a file ggml cannot read.");
}

}  // namespace kvflash::bindings
