#include "kvflash/json.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace kvflash::json {

Value Value::boolean(bool b) {
    Value v;
    v.kind_ = Kind::Bool;
    v.b_ = b;
    return v;
}

Value Value::integer(int64_t x) {
    Value v;
    v.kind_ = Kind::Int;
    v.i_ = x;
    return v;
}

Value Value::uinteger(uint64_t x) {
    if (x <= uint64_t(std::numeric_limits<int64_t>::max())) return integer(int64_t(x));
    Value v;
    v.kind_ = Kind::UInt;
    v.u_ = x;
    return v;
}

Value Value::number(double x) {
    Value v;
    v.kind_ = Kind::Float;
    v.d_ = x;
    return v;
}

Value Value::string(std::string s) {
    Value v;
    v.kind_ = Kind::String;
    v.s_ = std::move(s);
    return v;
}

Value Value::array(std::vector<Value> items) {
    Value v;
    v.kind_ = Kind::Array;
    v.items_ = std::move(items);
    return v;
}

Value Value::object() {
    Value v;
    v.kind_ = Kind::Object;
    return v;
}

double Value::as_double() const {
    switch (kind_) {
    case Kind::Int: return double(i_);
    case Kind::UInt: return double(u_);
    case Kind::Float: return d_;
    default: return 0;
    }
}

bool Value::int_in(int64_t lo, int64_t hi, int64_t *out) const {
    if (kind_ != Kind::Int || i_ < lo || i_ > hi) return false;
    if (out) *out = i_;
    return true;
}

bool Value::uint_value(uint64_t *out) const {
    if (kind_ == Kind::UInt) {
        if (out) *out = u_;
        return true;
    }
    if (kind_ == Kind::Int && i_ >= 0) {
        if (out) *out = uint64_t(i_);
        return true;
    }
    return false;
}

const Value *Value::find(const std::string &key) const {
    for (const auto &m : members_)
        if (m.first == key) return &m.second;
    return nullptr;
}

Value &Value::set(const std::string &key, Value v) {
    for (auto &m : members_)
        if (m.first == key) return m.second = std::move(v);
    members_.emplace_back(key, std::move(v));
    return members_.back().second;
}

namespace {

void put_number(std::string &out, double d) {
    if (std::isnan(d)) {
        out += "NaN";
        return;
    }
    if (std::isinf(d)) {
        out += d > 0 ? "Infinity" : "-Infinity";
        return;
    }
    // the shortest text that reads back as the same double
    char buf[40];
    for (int prec = 1; prec <= 17; ++prec) {
        std::snprintf(buf, sizeof buf, "%.*g", prec, d);
        if (std::strtod(buf, nullptr) == d) break;
    }
    std::string s(buf);
    if (s.find_first_of(".eEn") == std::string::npos) s += ".0";   // stays a float when read back
    out += s;
}

void put_string(std::string &out, const std::string &s, char quote, bool python) {
    out += quote;
    for (unsigned char c : s) {
        if (c == static_cast<unsigned char>(quote) || c == '\\') {
            out += '\\';
            out += char(c);
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '\t') {
            out += "\\t";
        } else if (c == '\r') {
            out += "\\r";
        } else if (c < 0x20 || c == 0x7f) {
            char buf[8];
            std::snprintf(buf, sizeof buf, python ? "\\x%02x" : "\\u%04x", c);
            out += buf;
        } else {
            out += char(c);
        }
    }
    out += quote;
}

void dump_to(std::string &out, const Value &v, bool python) {
    switch (v.kind()) {
    case Value::Kind::Null: out += python ? "None" : "null"; break;
    case Value::Kind::Bool: out += v.as_bool() ? (python ? "True" : "true") : (python ? "False" : "false"); break;
    case Value::Kind::Int: {
        int64_t x = 0;
        v.int_in(std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), &x);
        out += std::to_string(x);
        break;
    }
    case Value::Kind::UInt: {
        uint64_t x = 0;
        v.uint_value(&x);
        out += std::to_string(x);
        break;
    }
    case Value::Kind::Float:
        if (python && std::isnan(v.as_double())) out += "nan";
        else if (python && std::isinf(v.as_double())) out += v.as_double() > 0 ? "inf" : "-inf";
        else put_number(out, v.as_double());
        break;
    case Value::Kind::String: put_string(out, v.as_string(), python ? '\'' : '"', python); break;
    case Value::Kind::Array: {
        out += '[';
        bool first = true;
        for (const auto &x : v.items()) {
            if (!first) out += python ? ", " : ",";
            first = false;
            dump_to(out, x, python);
        }
        out += ']';
        break;
    }
    case Value::Kind::Object: {
        out += '{';
        bool first = true;
        for (const auto &m : v.members()) {
            if (!first) out += python ? ", " : ",";
            first = false;
            put_string(out, m.first, python ? '\'' : '"', python);
            out += python ? ": " : ":";
            dump_to(out, m.second, python);
        }
        out += '}';
        break;
    }
    }
}

class Parser {
public:
    Parser(const std::string &t, int max_depth) : t_(t), max_depth_(max_depth) {}

    Value document() {
        Value v = value(0);
        ws();
        if (p_ != t_.size()) fail("trailing bytes after the value");
        return v;
    }

private:
    [[noreturn]] void fail(const std::string &why) const {
        throw JsonError("not JSON at byte " + std::to_string(p_) + ": " + why);
    }
    void ws() {
        while (p_ < t_.size() && (t_[p_] == ' ' || t_[p_] == '\t' || t_[p_] == '\n' || t_[p_] == '\r')) ++p_;
    }
    bool eat(const char *word) {
        const size_t n = std::strlen(word);
        if (t_.compare(p_, n, word) != 0) return false;
        p_ += n;
        return true;
    }

    Value value(int depth) {
        if (depth > max_depth_) fail("nested deeper than " + std::to_string(max_depth_));
        ws();
        if (p_ >= t_.size()) fail("a value was expected");
        const char c = t_[p_];
        if (c == '{') return object(depth);
        if (c == '[') return array(depth);
        if (c == '"') return Value::string(string());
        if (eat("null")) return Value::null();
        if (eat("true")) return Value::boolean(true);
        if (eat("false")) return Value::boolean(false);
        if (eat("Infinity")) return Value::number(std::numeric_limits<double>::infinity());
        if (eat("-Infinity")) return Value::number(-std::numeric_limits<double>::infinity());
        if (eat("NaN")) return Value::number(std::numeric_limits<double>::quiet_NaN());
        if (c == '-' || (c >= '0' && c <= '9')) return number();
        fail("unexpected character");
    }

    Value object(int depth) {
        ++p_;
        Value o = Value::object();
        ws();
        if (p_ < t_.size() && t_[p_] == '}') {
            ++p_;
            return o;
        }
        for (;;) {
            ws();
            if (p_ >= t_.size() || t_[p_] != '"') fail("an object key was expected");
            std::string k = string();
            if (o.find(k)) fail("duplicate key \"" + k + "\"");
            ws();
            if (p_ >= t_.size() || t_[p_] != ':') fail("':' was expected");
            ++p_;
            o.set(k, value(depth + 1));
            ws();
            if (p_ < t_.size() && t_[p_] == ',') {
                ++p_;
                continue;
            }
            if (p_ < t_.size() && t_[p_] == '}') {
                ++p_;
                return o;
            }
            fail("',' or '}' was expected");
        }
    }

    Value array(int depth) {
        ++p_;
        Value a = Value::array();
        ws();
        if (p_ < t_.size() && t_[p_] == ']') {
            ++p_;
            return a;
        }
        for (;;) {
            a.push(value(depth + 1));
            ws();
            if (p_ < t_.size() && t_[p_] == ',') {
                ++p_;
                continue;
            }
            if (p_ < t_.size() && t_[p_] == ']') {
                ++p_;
                return a;
            }
            fail("',' or ']' was expected");
        }
    }

    static void put_utf8(std::string &out, uint32_t cp) {
        if (cp < 0x80) {
            out += char(cp);
        } else if (cp < 0x800) {
            out += char(0xC0 | (cp >> 6));
            out += char(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            out += char(0xE0 | (cp >> 12));
            out += char(0x80 | ((cp >> 6) & 0x3F));
            out += char(0x80 | (cp & 0x3F));
        } else {
            out += char(0xF0 | (cp >> 18));
            out += char(0x80 | ((cp >> 12) & 0x3F));
            out += char(0x80 | ((cp >> 6) & 0x3F));
            out += char(0x80 | (cp & 0x3F));
        }
    }

    uint32_t hex4() {
        if (p_ + 4 > t_.size()) fail("a \\u escape needs four hex digits");
        uint32_t v = 0;
        for (int i = 0; i < 4; ++i) {
            const char h = t_[p_++];
            v <<= 4;
            if (h >= '0' && h <= '9') v |= uint32_t(h - '0');
            else if (h >= 'a' && h <= 'f') v |= uint32_t(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F') v |= uint32_t(h - 'A' + 10);
            else fail("a \\u escape needs four hex digits");
        }
        return v;
    }

    // One UTF-8 sequence from the text, checked (no overlongs, no surrogates, <= U+10FFFF).
    void utf8(std::string &out) {
        const auto b0 = static_cast<unsigned char>(t_[p_]);
        int n = 0;
        uint32_t cp = 0, lo = 0;
        if (b0 >= 0xC2 && b0 <= 0xDF) n = 1, cp = b0 & 0x1F, lo = 0x80;
        else if (b0 >= 0xE0 && b0 <= 0xEF) n = 2, cp = b0 & 0x0F, lo = 0x800;
        else if (b0 >= 0xF0 && b0 <= 0xF4) n = 3, cp = b0 & 0x07, lo = 0x10000;
        else fail("invalid UTF-8");
        if (p_ + size_t(n) >= t_.size()) fail("invalid UTF-8");
        for (int i = 1; i <= n; ++i) {
            const auto b = static_cast<unsigned char>(t_[p_ + size_t(i)]);
            if ((b & 0xC0) != 0x80) fail("invalid UTF-8");
            cp = (cp << 6) | (b & 0x3F);
        }
        if (cp < lo || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) fail("invalid UTF-8");
        out.append(t_, p_, size_t(n) + 1);
        p_ += size_t(n) + 1;
    }

    std::string string() {
        ++p_;   // the opening quote
        std::string out;
        for (;;) {
            if (p_ >= t_.size()) fail("an unterminated string");
            const auto c = static_cast<unsigned char>(t_[p_]);
            if (c == '"') {
                ++p_;
                return out;
            }
            if (c < 0x20) fail("a control character in a string");
            if (c >= 0x80) {
                utf8(out);
                continue;
            }
            ++p_;
            if (c != '\\') {
                out += char(c);
                continue;
            }
            if (p_ >= t_.size()) fail("an unterminated escape");
            const char e = t_[p_++];
            switch (e) {
            case '"': out += '"'; break;
            case '\\': out += '\\'; break;
            case '/': out += '/'; break;
            case 'b': out += '\b'; break;
            case 'f': out += '\f'; break;
            case 'n': out += '\n'; break;
            case 'r': out += '\r'; break;
            case 't': out += '\t'; break;
            case 'u': {
                uint32_t cp = hex4();
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    if (!eat("\\u")) fail("a lone surrogate");
                    const uint32_t lo = hex4();
                    if (lo < 0xDC00 || lo > 0xDFFF) fail("a lone surrogate");
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                    fail("a lone surrogate");
                }
                put_utf8(out, cp);
                break;
            }
            default: fail("an unknown escape");
            }
        }
    }

    Value number() {
        const size_t start = p_;
        if (t_[p_] == '-') ++p_;
        if (p_ >= t_.size() || !(t_[p_] >= '0' && t_[p_] <= '9')) fail("a number was expected");
        if (t_[p_] == '0') ++p_;
        else
            while (p_ < t_.size() && t_[p_] >= '0' && t_[p_] <= '9') ++p_;
        bool integral = true;
        if (p_ < t_.size() && t_[p_] == '.') {
            integral = false;
            ++p_;
            if (p_ >= t_.size() || !(t_[p_] >= '0' && t_[p_] <= '9')) fail("digits after '.' were expected");
            while (p_ < t_.size() && t_[p_] >= '0' && t_[p_] <= '9') ++p_;
        }
        if (p_ < t_.size() && (t_[p_] == 'e' || t_[p_] == 'E')) {
            integral = false;
            ++p_;
            if (p_ < t_.size() && (t_[p_] == '+' || t_[p_] == '-')) ++p_;
            if (p_ >= t_.size() || !(t_[p_] >= '0' && t_[p_] <= '9')) fail("exponent digits were expected");
            while (p_ < t_.size() && t_[p_] >= '0' && t_[p_] <= '9') ++p_;
        }
        const std::string text = t_.substr(start, p_ - start);
        errno = 0;
        if (integral) {
            if (text[0] == '-') {
                const long long v = std::strtoll(text.c_str(), nullptr, 10);
                if (errno != ERANGE) return Value::integer(v);
            } else {
                const unsigned long long v = std::strtoull(text.c_str(), nullptr, 10);
                if (errno != ERANGE) return Value::uinteger(v);
            }
            errno = 0;   // an integer past 64 bits: kept as a double, as a range check then refuses it
        }
        const double d = std::strtod(text.c_str(), nullptr);
        return Value::number(d);
    }

    const std::string &t_;
    size_t p_ = 0;
    int max_depth_;
};

}  // namespace

std::string Value::dump() const {
    std::string out;
    dump_to(out, *this, false);
    return out;
}

std::string Value::repr() const {
    std::string out;
    dump_to(out, *this, true);
    return out;
}

Value parse(const std::string &text, int max_depth) { return Parser(text, max_depth).document(); }

}  // namespace kvflash::json
