#include "json.h"

#include <limits>
#include <set>

namespace aotc::json {

namespace {

constexpr int kMaxDepth = 64;

class Parser {
 public:
  explicit Parser(std::string_view s) : s_(s) {}

  Value document() {
    Value v = value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("trailing bytes after the document");
    return v;
  }

 private:
  std::string_view s_;
  size_t pos_ = 0;

  [[noreturn]] void fail(const std::string& why) const {
    throw Error("invalid JSON at byte " + std::to_string(pos_) + ": " + why);
  }

  bool at_end() const { return pos_ >= s_.size(); }
  char peek() const { return at_end() ? '\0' : s_[pos_]; }

  void skip_ws() {
    while (!at_end() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }

  void expect(char c) {
    if (peek() != c || at_end()) fail(std::string("expected '") + c + "'");
    ++pos_;
  }

  void literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) fail("unexpected token");
    pos_ += word.size();
  }

  Value value(int depth) {
    if (depth > kMaxDepth) fail("nested deeper than 64");
    skip_ws();
    Value v;
    switch (peek()) {
      case '{': object(v, depth); break;
      case '[': array(v, depth); break;
      case '"': v.type = Value::Type::String; v.text = string(); break;
      case 't': literal("true"); v.type = Value::Type::Bool; v.boolean = true; break;
      case 'f': literal("false"); v.type = Value::Type::Bool; v.boolean = false; break;
      case 'n': literal("null"); v.type = Value::Type::Null; break;
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) {
          v.type = Value::Type::Number;
          v.text = number();
        } else {
          fail(at_end() ? "unexpected end" : "unexpected character");
        }
    }
    return v;
  }

  void object(Value& v, int depth) {
    v.type = Value::Type::Object;
    expect('{');
    skip_ws();
    if (peek() == '}') { ++pos_; return; }
    // An ordered set, not a scan of the keys so far (quadratic: 14 s of CPU for a 1 MiB manifest, parsed before its
    // signature is checked) nor a hash set (std::hash is not seeded, so chosen keys could collide into the same).
    std::set<std::string> seen;
    for (;;) {
      skip_ws();
      if (peek() != '"') fail("expected a string key");
      std::string key = string();
      if (!seen.insert(key).second) fail("duplicate key \"" + key + "\"");
      skip_ws();
      expect(':');
      v.items.push_back(value(depth + 1));
      v.keys.push_back(std::move(key));
      skip_ws();
      if (peek() == ',') { ++pos_; continue; }
      expect('}');
      return;
    }
  }

  void array(Value& v, int depth) {
    v.type = Value::Type::Array;
    expect('[');
    skip_ws();
    if (peek() == ']') { ++pos_; return; }
    for (;;) {
      v.items.push_back(value(depth + 1));
      skip_ws();
      if (peek() == ',') { ++pos_; continue; }
      expect(']');
      return;
    }
  }

  std::string number() {
    size_t start = pos_;
    auto digits = [&] {
      size_t n = 0;
      while (!at_end() && s_[pos_] >= '0' && s_[pos_] <= '9') { ++pos_; ++n; }
      return n;
    };
    if (peek() == '-') ++pos_;
    if (peek() == '0') {
      ++pos_;
      if (peek() >= '0' && peek() <= '9') fail("leading zero in a number");
    } else if (digits() == 0) {
      fail("expected a digit");
    }
    if (peek() == '.') {
      ++pos_;
      if (digits() == 0) fail("expected a digit after '.'");
    }
    if (peek() == 'e' || peek() == 'E') {
      ++pos_;
      if (peek() == '+' || peek() == '-') ++pos_;
      if (digits() == 0) fail("expected a digit in the exponent");
    }
    return std::string(s_.substr(start, pos_ - start));
  }

  unsigned hex4() {
    if (pos_ + 4 > s_.size()) fail("truncated \\u escape");
    unsigned cp = 0;
    for (int i = 0; i < 4; ++i) {
      char c = s_[pos_++];
      cp <<= 4;
      if (c >= '0' && c <= '9') cp |= unsigned(c - '0');
      else if (c >= 'a' && c <= 'f') cp |= unsigned(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') cp |= unsigned(c - 'A' + 10);
      else fail("bad hex digit in a \\u escape");
    }
    return cp;
  }

  static void put_utf8(std::string& out, unsigned cp) {
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

  // One UTF-8 sequence copied as is, after checking it is well formed (no overlongs, no surrogates, <= U+10FFFF).
  void raw_utf8(std::string& out) {
    auto b0 = static_cast<unsigned char>(s_[pos_]);
    int n;
    unsigned cp;
    if (b0 < 0x80) { n = 0; cp = b0; }
    else if ((b0 & 0xE0) == 0xC0) { n = 1; cp = b0 & 0x1F; }
    else if ((b0 & 0xF0) == 0xE0) { n = 2; cp = b0 & 0x0F; }
    else if ((b0 & 0xF8) == 0xF0) { n = 3; cp = b0 & 0x07; }
    else fail("invalid UTF-8");
    if (pos_ + 1 + size_t(n) > s_.size()) fail("truncated UTF-8");
    for (int i = 1; i <= n; ++i) {
      auto b = static_cast<unsigned char>(s_[pos_ + size_t(i)]);
      if ((b & 0xC0) != 0x80) fail("invalid UTF-8");
      cp = (cp << 6) | (b & 0x3F);
    }
    static const unsigned kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) fail("invalid UTF-8");
    out.append(s_.substr(pos_, size_t(n) + 1));
    pos_ += size_t(n) + 1;
  }

  std::string string() {
    expect('"');
    std::string out;
    for (;;) {
      if (at_end()) fail("unterminated string");
      char c = s_[pos_];
      if (c == '"') { ++pos_; return out; }
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') { raw_utf8(out); continue; }
      ++pos_;
      if (at_end()) fail("unterminated escape");
      char e = s_[pos_++];
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
          unsigned cp = hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) fail("lone low surrogate");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (s_.substr(pos_, 2) != "\\u") fail("lone high surrogate");
            pos_ += 2;
            unsigned lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("lone high surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          put_utf8(out, cp);
          break;
        }
        default: fail("bad escape");
      }
    }
  }
};

}  // namespace

const Value* Value::find(std::string_view key) const {
  if (type != Type::Object) return nullptr;
  for (size_t i = 0; i < keys.size(); ++i)
    if (keys[i] == key) return &items[i];
  return nullptr;
}

Value parse(std::string_view text) { return Parser(text).document(); }

std::uint64_t as_uint64(const Value& v, std::string_view what) {
  const std::string& t = v.text;
  bool plain = v.type == Value::Type::Number && !t.empty() && t.size() <= 20 &&
               t.find_first_not_of("0123456789") == std::string::npos;
  if (!plain) throw Error(std::string(what) + " is not a non-negative integer");
  std::uint64_t n = 0;
  for (char c : t) {
    auto d = std::uint64_t(c - '0');
    if (n > (std::numeric_limits<std::uint64_t>::max() - d) / 10) throw Error(std::string(what) + " is too large");
    n = n * 10 + d;
  }
  return n;
}

}  // namespace aotc::json
