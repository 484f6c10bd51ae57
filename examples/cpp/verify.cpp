#include "verify.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string_view>

#include <openssl/evp.h>
#include <openssl/opensslv.h>

#include "json.h"

#if OPENSSL_VERSION_NUMBER < 0x10101000L
#error "Ed25519 needs OpenSSL 1.1.1 or newer"
#endif

namespace aotc {

namespace {

constexpr const char* kPayloadType = "application/vnd.in-toto+json";
constexpr const char* kStatementType = "https://in-toto.io/Statement/v1";
constexpr const char* kPredicateType = "https://aotc.dev/artifact-manifest/v1";
constexpr std::uint64_t kMaxManifestBytes = 1 << 20;

struct PkeyFree { void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); } };
struct MdCtxFree { void operator()(EVP_MD_CTX* p) const { EVP_MD_CTX_free(p); } };

std::string hex(const unsigned char* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out += d[p[i] >> 4];
    out += d[p[i] & 15];
  }
  return out;
}

std::string sha256_hex(const std::string& bytes) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), md, &n, EVP_sha256(), nullptr) != 1)
    throw std::runtime_error("OpenSSL: sha256 failed");
  return hex(md, n);
}

// Standard base64 with padding, nothing else (no whitespace, no URL-safe alphabet): OpenSSL's EVP_DecodeBlock
// skips surrounding whitespace and does not report padding, so the input is checked first.
std::string b64decode(const std::string& s, const std::string& what) {
  auto bad = [&] { return Refused(what + " is not standard base64"); };
  if (s.empty() || s.size() % 4 != 0 || s.size() > kMaxManifestBytes * 2) throw bad();
  size_t pad = 0;
  if (s[s.size() - 1] == '=') ++pad;
  if (s[s.size() - 2] == '=') ++pad;
  for (size_t i = 0; i < s.size() - pad; ++i) {
    char c = s[i];
    if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '+' || c == '/'))
      throw bad();
  }
  std::string out(s.size() / 4 * 3, '\0');
  int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(s.data()), static_cast<int>(s.size()));
  if (n < 0 || size_t(n) != out.size()) throw bad();
  out.resize(out.size() - pad);
  return out;
}

bool ed25519_verify(const std::string& pub, const std::string& msg, const std::string& sig) {
  if (pub.size() != 32 || sig.size() != 64) return false;
  std::unique_ptr<EVP_PKEY, PkeyFree> key(EVP_PKEY_new_raw_public_key(
      EVP_PKEY_ED25519, nullptr, reinterpret_cast<const unsigned char*>(pub.data()), pub.size()));
  std::unique_ptr<EVP_MD_CTX, MdCtxFree> ctx(EVP_MD_CTX_new());
  if (!key || !ctx) throw std::runtime_error("OpenSSL: cannot set up an Ed25519 key");
  if (EVP_DigestVerifyInit(ctx.get(), nullptr, nullptr, nullptr, key.get()) != 1)
    throw std::runtime_error("OpenSSL: EVP_DigestVerifyInit failed for Ed25519");
  return EVP_DigestVerify(ctx.get(), reinterpret_cast<const unsigned char*>(sig.data()), sig.size(),
                          reinterpret_cast<const unsigned char*>(msg.data()), msg.size()) == 1;
}

// DSSE's pre-authentication encoding: what the signature covers.
std::string pae(const std::string& type, const std::string& body) {
  return "DSSEv1 " + std::to_string(type.size()) + " " + type + " " + std::to_string(body.size()) + " " + body;
}

// `where` by value: a temporary std::string bound to a reference parameter makes g++ 13 warn that the returned
// reference may dangle (-Wdangling-reference), though it points into `obj`.
const json::Value& member(const json::Value& obj, const char* key, json::Value::Type type, std::string_view where) {
  const json::Value* v = obj.find(key);
  if (!v) throw Refused(std::string(where) + " has no \"" + key + "\"");
  if (v->type != type) throw Refused(std::string(where) + "'s \"" + key + "\" has the wrong type");
  return *v;
}

// `text` as a JSON object: Refused with `bad_json` and the parser's message, or with `not_object`.
json::Value parse_object(const std::string& text, const std::string& bad_json, const std::string& not_object) {
  json::Value v;
  try {
    v = json::parse(text);
  } catch (const json::Error& e) {
    throw Refused(bad_json + e.what());
  }
  if (!v.is_object()) throw Refused(not_object);
  return v;
}

bool is_sha256_hex(const std::string& s) {
  return s.size() == 64 && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

std::string join(const std::vector<std::string>& xs) {
  std::string out;
  for (const auto& x : xs) out += (out.empty() ? "" : ", ") + x;
  return out.empty() ? "none" : out;
}

std::vector<std::int64_t> int_list(const json::Value& v, const std::string& what) {
  if (!v.is_array()) throw Refused(what + " is not a list");
  std::vector<std::int64_t> out;
  for (const auto& item : v.items) {
    try {
      std::uint64_t n = json::as_uint64(item, what);
      if (n > (std::uint64_t(1) << 62)) throw Refused(what + " holds a number too large");
      out.push_back(std::int64_t(n));
    } catch (const json::Error& e) {
      throw Refused(e.what());
    }
  }
  return out;
}

// The predicate's "weights": {"sha256", "size", "constants": [{"fqn", "shape", "dtype", "stride"}, ...]}.
void read_weights(const json::Value& w, Expected& out) {
  using T = json::Value::Type;
  if (!w.is_object()) throw Refused("predicate weights is not an object");
  out.weights_sha256 = member(w, "sha256", T::String, "predicate weights").text;
  if (!is_sha256_hex(out.weights_sha256)) throw Refused("predicate weights sha256 is not 64 lowercase hex digits");
  try {
    out.weights_size = json::as_uint64(member(w, "size", T::Number, "predicate weights"), "predicate weights size");
  } catch (const json::Error& e) {
    throw Refused(e.what());
  }
  for (const auto& c : member(w, "constants", T::Array, "predicate weights").items) {
    if (!c.is_object()) throw Refused("a signed constant is not an object");
    Constant k;
    k.fqn = member(c, "fqn", T::String, "signed constant").text;
    k.dtype = member(c, "dtype", T::String, "signed constant " + k.fqn).text;
    k.shape = int_list(member(c, "shape", T::Array, "signed constant " + k.fqn), "shape of " + k.fqn);
    k.stride = int_list(member(c, "stride", T::Array, "signed constant " + k.fqn), "stride of " + k.fqn);
    if (k.shape.size() != k.stride.size()) throw Refused("signed constant " + k.fqn + ": shape and stride differ");
    out.constants.push_back(std::move(k));
  }
}

// The signed check's training record, predicate.check.training: {"outputs": [{"role", "index"}, ...], ...}.
void read_train_roles(const json::Value& check, Expected& out) {
  using T = json::Value::Type;
  const json::Value* tr = check.find("training");
  if (tr == nullptr || tr->type == T::Null) return;
  for (const auto& r : member(*tr, "outputs", T::Array, "predicate check training").items) {
    if (!r.is_object()) throw Refused("a signed output role is not an object");
    std::string role = member(r, "role", T::String, "signed output role").text;
    std::uint64_t index = 0;
    try {
      index = json::as_uint64(member(r, "index", T::Number, "signed output role " + role), "index of " + role);
    } catch (const json::Error& e) {
      throw Refused(e.what());
    }
    out.train_roles.emplace_back(std::move(role), static_cast<std::size_t>(index));
  }
  if (out.train_roles.empty()) throw Refused("predicate check training lists no output roles");
}

}  // namespace


std::string read_file(const std::string& path, std::uint64_t max_bytes) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path + ": " + std::strerror(errno));
  std::ostringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  if (s.size() > max_bytes) throw std::runtime_error(path + " is larger than " + std::to_string(max_bytes) + " bytes");
  return s;
}

TrustedKey read_trusted_key(const std::string& path) {
  std::string text = read_file(path, 4096);
  const char* ws = " \t\r\n";
  size_t a = text.find_first_not_of(ws), b = text.find_last_not_of(ws);
  text = a == std::string::npos ? "" : text.substr(a, b - a + 1);
  std::string raw = b64decode(text, "trusted key " + path);
  if (raw.size() != 32) throw Refused("trusted key " + path + " is " + std::to_string(raw.size()) +
                                      " bytes; an Ed25519 public key is 32");
  return {raw, sha256_hex(raw).substr(0, 16)};
}

Expected verify_manifest(const std::string& envelope_json, const std::vector<TrustedKey>& keys,
                         const std::vector<std::string>& revoked, const std::string& artifact_key) {
  using T = json::Value::Type;
  if (envelope_json.size() > kMaxManifestBytes) throw Refused("manifest is larger than 1 MiB");
  const json::Value env = parse_object(envelope_json, "manifest is not a DSSE envelope: ",
                                       "manifest is not a DSSE envelope: not a JSON object");
  const std::string& type = member(env, "payloadType", T::String, "envelope").text;
  if (type != kPayloadType) throw Refused("envelope payloadType is \"" + type + "\", expected " + kPayloadType);
  const std::string payload = b64decode(member(env, "payload", T::String, "envelope").text, "envelope payload");
  const json::Value& sigs = member(env, "signatures", T::Array, "envelope");

  // The signature first; the statement is parsed only once a trusted key has vouched for its bytes. keyid is an
  // unsigned hint (DSSE): a signature without one may be by any trusted key.
  const std::string signed_bytes = pae(type, payload);
  std::vector<std::string> trusted, unknown, bad, revoked_by;
  for (const auto& k : keys) trusted.push_back(k.keyid);
  std::string signer;
  for (const auto& s : sigs.items) {
    if (!s.is_object()) throw Refused("envelope signature is not an object");
    std::string kid;
    if (const json::Value* v = s.find("keyid")) {
      if (!v->is_string()) throw Refused("envelope signature's \"keyid\" has the wrong type");
      kid = v->text;
    }
    const std::string sig = b64decode(member(s, "sig", T::String, "envelope signature").text, "signature");
    bool candidate = false, verified = false;
    for (const auto& k : keys) {
      if (!kid.empty() && k.keyid != kid) continue;
      candidate = true;
      if (!ed25519_verify(k.raw, signed_bytes, sig)) continue;
      verified = true;
      if (std::find(revoked.begin(), revoked.end(), k.keyid) != revoked.end()) revoked_by.push_back(k.keyid);
      else signer = k.keyid;
      break;
    }
    if (!signer.empty()) break;
    if (!candidate) unknown.push_back(kid);
    else if (!verified) bad.push_back(kid.empty() ? "(no keyid)" : kid);
  }
  if (signer.empty()) {
    if (sigs.items.empty()) throw Refused("the manifest carries no signature");
    if (!revoked_by.empty())
      throw Refused("revoked key: the manifest is signed by key " + join(revoked_by) +
                    ", which the service lists as revoked");
    if (!bad.empty())
      throw Refused("bad signature: the manifest's signature does not verify with trusted key " +
                    (bad[0] == "(no keyid)" ? join(trusted) : join(bad)));
    throw Refused("unknown key: the manifest is signed by key " + join(unknown) + "; trusted: " + join(trusted));
  }

  const json::Value st = parse_object(payload, "signed statement is not valid JSON: ",
                                      "signed statement is not a JSON object");
  const std::string& st_type = member(st, "_type", T::String, "statement").text;
  if (st_type != kStatementType) throw Refused("statement _type is \"" + st_type + "\", expected " + kStatementType);

  const std::string& pred_type = member(st, "predicateType", T::String, "statement").text;
  if (pred_type != kPredicateType)
    throw Refused("statement predicateType is \"" + pred_type + "\", expected " + kPredicateType);
  const json::Value& subjects = member(st, "subject", T::Array, "statement");
  if (subjects.items.size() != 1 || !subjects.items[0].is_object())
    throw Refused("the signed statement does not name exactly one artifact");
  const json::Value* subject = &subjects.items[0];
  const std::string& name = member(*subject, "name", T::String, "statement subject").text;
  if (name != artifact_key)
    throw Refused("subject mismatch: the manifest is signed for artifact " + name + ", not " + artifact_key);
  const json::Value& digest = member(*subject, "digest", T::Object, "statement subject");
  const std::string& sha = member(digest, "sha256", T::String, "subject digest").text;
  if (!is_sha256_hex(sha)) throw Refused("subject digest sha256 is not 64 lowercase hex digits");

  const json::Value& pred = member(st, "predicate", T::Object, "statement");
  const std::string& pred_key = member(pred, "artifact_key", T::String, "predicate").text;
  const std::string& pred_sha = member(pred, "package_sha256", T::String, "predicate").text;
  if (pred_key != artifact_key)
    throw Refused("subject mismatch: predicate artifact_key is " + pred_key + ", not " + artifact_key);
  if (pred_sha != sha) throw Refused("manifest is inconsistent: predicate package_sha256 differs from the subject's");
  std::uint64_t size;
  try {
    size = json::as_uint64(member(pred, "package_size", T::Number, "predicate"), "predicate package_size");
  } catch (const json::Error& e) {
    throw Refused(e.what());
  }
  Expected out{artifact_key, sha, size, signer, "", 0, {}, {}};
  if (const json::Value* w = pred.find("weights")) read_weights(*w, out);
  if (const json::Value* c = pred.find("check"); c != nullptr && c->is_object()) read_train_roles(*c, out);
  if (const json::Value* t = pred.find("target"); t != nullptr && t->is_string()) out.target = t->text;
  if (const json::Value* ot = pred.find("on_target"); ot != nullptr && ot->is_object())
    if (const json::Value* run = ot->find("run"); run != nullptr && run->type == T::Bool && !run->boolean)
      out.run_on_target = false;
  return out;
}

void check_weights(const Digest& got, const Expected& want, const std::string& path) {
  if (got.size != want.weights_size || got.sha256 != want.weights_sha256)
    throw Refused("weights " + path + " have sha256 " + got.sha256 + " (" + std::to_string(got.size) +
                  " bytes); the manifest says " + want.weights_sha256 + " (" + std::to_string(want.weights_size) +
                  " bytes)");
}

Digest copy_and_hash(const std::string& src, const std::string& dst) {
  int in = ::open(src.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) throw std::runtime_error("cannot open package " + src + ": " + std::strerror(errno));
  int out = ::open(dst.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (out < 0) {
    ::close(in);
    throw std::runtime_error("cannot create " + dst + ": " + std::strerror(errno));
  }
  std::unique_ptr<EVP_MD_CTX, MdCtxFree> ctx(EVP_MD_CTX_new());
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) throw std::runtime_error("OpenSSL: sha256");
  std::vector<char> buf(1 << 20);
  Digest d;
  std::string err;
  for (;;) {
    ssize_t n = ::read(in, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) { err = "cannot read package " + src + ": " + std::strerror(errno); break; }
    if (n == 0) break;
    EVP_DigestUpdate(ctx.get(), buf.data(), size_t(n));
    d.size += std::uint64_t(n);
    for (ssize_t off = 0; off < n;) {
      ssize_t w = ::write(out, buf.data() + off, size_t(n - off));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) { err = "cannot write " + dst + ": " + std::strerror(errno); break; }
      off += w;
    }
    if (!err.empty()) break;
  }
  ::close(in);
  if (::close(out) != 0 && err.empty()) err = "cannot write " + dst + ": " + std::strerror(errno);
  if (!err.empty()) throw std::runtime_error(err);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_DigestFinal_ex(ctx.get(), md, &n);
  d.sha256 = hex(md, n);
  return d;
}

std::vector<std::string> read_revoked(const std::string& path) {
  using T = json::Value::Type;
  const json::Value doc = parse_object(read_file(path, kMaxManifestBytes), "signing keys " + path + ": ",
                                       "signing keys " + path + " is not GET /v1/signing-keys's JSON object");
  std::vector<std::string> out;
  for (const auto& rec : member(doc, "keys", T::Array, "signing keys " + path).items) {
    if (!rec.is_object()) throw Refused("signing keys " + path + ": a key record is not an object");
    const std::string& kid = member(rec, "kid", T::String, "signing key record").text;
    const json::Value* when = rec.find("revoked_at");
    if (when && when->type != T::Null) out.push_back(kid);
  }
  return out;
}

void check_package(const Digest& got, const Expected& want, const std::string& path) {
  if (got.size != want.size)
    throw Refused("package " + path + " is " + std::to_string(got.size) + " bytes; the manifest says " +
                  std::to_string(want.size));
  if (got.sha256 != want.sha256)
    throw Refused("package " + path + " has sha256 " + got.sha256 + "; the manifest says " + want.sha256);
}

}  // namespace aotc
