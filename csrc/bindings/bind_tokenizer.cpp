// _core.Vocab: the core tokenizer (tokenizer.h, llama.cpp's own).  Encoding copies the text, then
// releases the GIL: a server thread tokenizing megabytes leaves the others running.
#include "bindings.h"
#include "kvflash/tokenizer.h"

namespace kvflash::bindings {

namespace {

// pybind11 holds non-const pointers; every method bound is const.
using TokPtr = std::shared_ptr<Tokenizer>;
TokPtr held(std::shared_ptr<const Tokenizer> t) { return std::const_pointer_cast<Tokenizer>(std::move(t)); }

py::object id_or_none(int32_t id) { return id < 0 ? py::object(py::none()) : py::object(py::int_(id)); }

py::bytes as_bytes(const std::string &s) { return py::bytes(s.data(), s.size()); }

// GGUF strings are bytes; undecodable ones survive as surrogates (as gguf_metadata reads them).
py::str as_str(const std::string &s) {
    PyObject *o = PyUnicode_DecodeUTF8(s.data(), Py_ssize_t(s.size()), "surrogateescape");
    if (!o) throw py::error_already_set();
    return py::reinterpret_steal<py::str>(o);
}

// str -> UTF-8 bytes (a lone surrogate is a ValueError here, not pybind11's TypeError); bytes as they are
// (the core checks them).
std::string text_bytes(const py::handle &text) {
    if (PyBytes_Check(text.ptr())) return std::string(py::reinterpret_borrow<py::bytes>(text));
    if (!PyUnicode_Check(text.ptr())) throw py::type_error("text must be str or bytes");
    Py_ssize_t n = 0;
    const char *p = PyUnicode_AsUTF8AndSize(text.ptr(), &n);
    if (!p) {
        PyErr_Clear();
        throw std::invalid_argument("text is not encodable as UTF-8 (it holds a lone surrogate)");
    }
    return std::string(p, size_t(n));
}

}  // namespace

void bind_tokenizer(py::module_ &m) {
    py::class_<Tokenizer, TokPtr>(m, "Vocab", R"doc(
llama.cpp's tokenizer (llama_vocab from the pinned sdist) over a GGUF file's tokenizer.* metadata.
Immutable; every method may be called from several threads at once.  ValueError for a vocabulary
kvflash cannot use or text that is not UTF-8, IndexError for an id out of range.)doc")
        .def_static("load", [](const py::object &path) {
            const std::string p = py::str(path);
            py::gil_scoped_release nogil;
            return held(Tokenizer::load(p));
        }, py::arg("path"), "From a GGUF file's metadata (tensor data is never read).")
        .def_static("from_model", [](const std::shared_ptr<Model> &model) {
            if (!model) throw std::invalid_argument("model is None");
            py::gil_scoped_release nogil;
            return held(model->tokenizer());
        }, py::arg("model"), "The model's tokenizer (built on first use, shared after).")
        .def("encode", [](const Tokenizer &t, const py::handle &text, bool add_special, bool parse_special) {
            const std::string s = text_bytes(text);
            std::vector<int32_t> ids;
            {
                py::gil_scoped_release nogil;
                ids = t.encode(s, add_special, parse_special);
            }
            return ids;
        }, py::arg("text"), py::arg("add_special") = true, py::arg("parse_special") = false,
           "Token ids of text (str, or UTF-8 bytes), as llama_tokenize.")
        .def("token_to_piece", [](const Tokenizer &t, int32_t id, bool special) {
            return as_bytes(t.token_to_piece(id, special));
        }, py::arg("id"), py::arg("special") = true, "The token's bytes, as llama_token_to_piece (lstrip 0).")
        .def("pieces", [](const Tokenizer &t, bool special) {
            py::list out(size_t(t.n_vocab()));
            for (int32_t i = 0; i < t.n_vocab(); ++i) out[size_t(i)] = as_bytes(t.token_to_piece(i, special));
            return out;
        }, py::arg("special") = true, "token_to_piece of every id, in id order.")
        .def("decode", [](const Tokenizer &t, const std::vector<int32_t> &ids, bool remove_special, bool unparse_special) {
            std::string s;
            {
                py::gil_scoped_release nogil;
                s = t.decode(ids, remove_special, unparse_special);
            }
            return as_bytes(s);
        }, py::arg("ids"), py::arg("remove_special") = false, py::arg("unparse_special") = true,
           "The bytes of ids, as llama_detokenize.")
        .def_property_readonly("n_vocab", &Tokenizer::n_vocab)
        .def_property_readonly("model", &Tokenizer::model)
        .def_property_readonly("pre", [](const Tokenizer &t) { return t.pre().empty() ? py::object(py::none()) : py::object(py::str(t.pre())); })
        .def_property_readonly("bos_id", [](const Tokenizer &t) { return id_or_none(t.bos()); })
        .def_property_readonly("eos_id", [](const Tokenizer &t) { return id_or_none(t.eos()); })
        .def_property_readonly("eot_id", [](const Tokenizer &t) { return id_or_none(t.eot()); })
        .def_property_readonly("unk_id", [](const Tokenizer &t) { return id_or_none(t.unk()); })
        .def_property_readonly("pad_id", [](const Tokenizer &t) { return id_or_none(t.pad()); })
        .def_property_readonly("add_bos", &Tokenizer::add_bos)
        .def_property_readonly("add_eos", &Tokenizer::add_eos)
        .def_property_readonly("add_space_prefix", &Tokenizer::add_space_prefix)
        .def_property_readonly("eog_ids", &Tokenizer::eog_ids, "Ids that end generation (llama_vocab_is_eog), ascending.")
        .def("token_type", [](const Tokenizer &t, int32_t id) { return int32_t(t.token_type(id)); }, py::arg("id"),
             "The token's type from llama.cpp's attributes (1 normal, 2 unknown, 3 control, 4 user-defined, "
             "5 unused, 6 byte, 0 undefined).")
        .def("is_special", &Tokenizer::is_special, py::arg("id"), "Control or unknown (what skip_special drops).")
        .def("is_control", &Tokenizer::is_control, py::arg("id"))
        .def("is_eog", &Tokenizer::is_eog, py::arg("id"))
        .def("token_text", [](const Tokenizer &t, int32_t id) { return as_str(t.token_text(id)); }, py::arg("id"),
             "The vocabulary string (\"Ġworld\", \"▁the\").")
        .def_property_readonly_static("supported_models", [](const py::object &) { return Tokenizer::supported_models(); })
        .def("__repr__", [](const Tokenizer &t) {
            return "Vocab(model='" + t.model() + "', pre='" + t.pre() + "', n_vocab=" + std::to_string(t.n_vocab()) + ")";
        });
}

}  // namespace kvflash::bindings
