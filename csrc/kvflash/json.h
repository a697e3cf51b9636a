// A small JSON value, parser and writer for the session's own state in a snapshot (session_file.h).
//
// Enough JSON for that and no more: objects keep their keys in order (duplicate keys are refused),
// integers keep their exact value (int64 and uint64, as Python's json writes them), other numbers are
// doubles; Infinity, -Infinity and NaN are read and written as Python's json module does (what reads a
// value refuses a NaN where it needs a number).
// The parser is for hostile bytes: a depth limit, no recursion past it, every error a JsonError.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kvflash::json {

struct JsonError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

class Value {
public:
    enum class Kind { Null, Bool, Int, UInt, Float, String, Array, Object };

    Value() = default;
    static Value null() { return Value(); }
    static Value boolean(bool b);
    static Value integer(int64_t v);
    static Value uinteger(uint64_t v);
    static Value number(double v);
    static Value string(std::string s);
    static Value array(std::vector<Value> items = {});
    static Value object();

    Kind kind() const { return kind_; }
    bool is_null() const { return kind_ == Kind::Null; }
    bool is_bool() const { return kind_ == Kind::Bool; }
    bool is_string() const { return kind_ == Kind::String; }
    bool is_array() const { return kind_ == Kind::Array; }
    bool is_object() const { return kind_ == Kind::Object; }
    bool is_integer() const { return kind_ == Kind::Int || kind_ == Kind::UInt; }
    bool is_number() const { return is_integer() || kind_ == Kind::Float; }

    bool as_bool() const { return b_; }
    const std::string &as_string() const { return s_; }
    double as_double() const;
    // The integer's value when it lies in [lo, hi]; false otherwise (not an integer, or out of range).
    bool int_in(int64_t lo, int64_t hi, int64_t *out = nullptr) const;
    bool uint_value(uint64_t *out) const;   // an integer >= 0
    const std::vector<Value> &items() const { return items_; }
    const std::vector<std::pair<std::string, Value>> &members() const { return members_; }

    // objects
    const Value *find(const std::string &key) const;
    Value &set(const std::string &key, Value v);   // appends (or replaces) key
    void push(Value v) { items_.push_back(std::move(v)); }

    // Compact JSON text.
    std::string dump() const;
    // The value as Python's repr() writes the object json.loads makes of it ('a', True, None,
    // {'a': 1}, [1, 2]): what error messages quote, so a message reads the same from every client.
    std::string repr() const;

private:
    Kind kind_ = Kind::Null;
    bool b_ = false;
    int64_t i_ = 0;
    uint64_t u_ = 0;
    double d_ = 0;
    std::string s_;
    std::vector<Value> items_;
    std::vector<std::pair<std::string, Value>> members_;
};

// Parses text (UTF-8, one value, whitespace around it).  JsonError on anything else: bad UTF-8, a
// nesting deeper than max_depth, a duplicate key, trailing bytes.
Value parse(const std::string &text, int max_depth = 64);

}  // namespace kvflash::json
