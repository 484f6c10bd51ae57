// Verify before load: the checks a careful C++ inference server runs on a pulled aotc package before any of its
// bytes reach the loader (which dlopens the shared library inside it).
//
// The manifest is the one the service serves at GET /v1/artifacts/{key}/manifest: a DSSE envelope over an in-toto
// Statement v1, signed with Ed25519 (compiler/signing.py writes it):
//
//   {"payloadType": "application/vnd.in-toto+json", "payload": base64(statement),
//    "signatures": [{"keyid": kid, "sig": base64(ed25519(PAE(payloadType, statement)))}]}
//   PAE(type, body) = "DSSEv1 " + len(type) + " " + type + " " + len(body) + " " + body   (lengths in decimal)
//   statement = {"_type": "https://in-toto.io/Statement/v1",
//                "subject": [{"name": <artifact key>, "digest": {"sha256": <package sha256>}}],
//                "predicateType": "https://aotc.dev/artifact-manifest/v1",
//                "predicate": {"artifact_key", "package_sha256", "package_size", ...}}
//   kid = hex(sha256(raw 32-byte public key))[:16]
//
// Trusted keys are pinned by the server's operator (GET /v1/signing-keys lists the service's), one raw 32-byte
// Ed25519 public key per file, in standard base64. The checks and their order follow the SDK's (client/verify.py,
// compiler/signing.py verify), so a package one refuses the other refuses too.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace aotc {

// Every reason to refuse a package. main() prints it and exits non-zero without loading anything.
struct Refused : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct TrustedKey {
  std::string raw;    // 32 bytes
  std::string keyid;  // hex(sha256(raw))[:16]
};

// One constant a weightless package binds, as the manifest signs it (compiler/weights.py).
struct Constant {
  std::string fqn;
  std::string dtype;  // torch's name: float32, bfloat16, int64, ...
  std::vector<std::int64_t> shape, stride;
};

// What a valid manifest promises about the package.
struct Expected {
  std::string artifact_key;
  std::string sha256;  // lowercase hex
  std::uint64_t size = 0;
  std::string keyid;   // the trusted key that signed it
  // A weightless package's weights blob (predicate "weights"): its digest, size and constants. Empty sha256: the
  // package carries its own weights.
  std::string weights_sha256;
  std::uint64_t weights_size = 0;
  std::vector<Constant> constants;
  // A train-step package (mode=training): its flat outputs' roles as the signed check recorded them
  // (predicate.check.training.outputs): "loss", "output:i", "grad:<fqn>", each with its index. Empty: not a
  // train step.
  std::vector<std::pair<std::string, std::size_t>> train_roles;
  // False where the builder signed that it did not run the package on its target (predicate.on_target.run, a build
  // for another architecture or level). The Python SDK then wants a trusted countersignature of a check on the
  // target; this loader reads none, so it refuses such a package unless told --allow-unverified.
  bool run_on_target = true;
  std::string target;  // predicate.target, for the message
};

// A file holding one base64 public key (surrounding whitespace allowed).
TrustedKey read_trusted_key(const std::string& path);

// The ids of the keys a GET /v1/signing-keys answer (saved to `path`) lists as revoked. Pins decide which keys are
// trusted; the service's list can only take trust away (a revoked key's signatures are refused).
std::vector<std::string> read_revoked(const std::string& path);

// Checks the envelope's signature with the trusted keys (none of them `revoked`) and the statement against
// `artifact_key`; returns what the package must match. Throws Refused with the reason.
Expected verify_manifest(const std::string& envelope_json, const std::vector<TrustedKey>& keys,
                         const std::vector<std::string>& revoked, const std::string& artifact_key);

// Copies `src` to `dst` (a file in a private directory, so nobody can swap the bytes between the check and the
// load), hashing what it writes. Returns the sha256 (lowercase hex) and the size of the copy.
struct Digest {
  std::string sha256;
  std::uint64_t size = 0;
};
Digest copy_and_hash(const std::string& src, const std::string& dst);

// Throws Refused unless the copy's digest and size are the manifest's.
void check_package(const Digest& got, const Expected& want, const std::string& path);

// Throws Refused unless the weights copy's digest and size are the ones the manifest signs.
void check_weights(const Digest& got, const Expected& want, const std::string& path);

std::string read_file(const std::string& path, std::uint64_t max_bytes);

}  // namespace aotc
