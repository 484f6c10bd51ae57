// aotc_run: what a C++ inference server does with a package it pulled from aotc.
//
//   1. verify: the manifest's Ed25519 signature by a pinned key, the statement's subject against the artifact key
//      the server asked for, and the package's size and sha256 against the statement (verify.cpp);
//   2. load: torch::inductor::AOTIModelPackageLoader, from a private copy of the bytes that were hashed; a weightless
//      package's weights blob (--weights) is verified the same way, each constant checked against the manifest,
//      and bound with load_constants(..., user_managed=true);
//   3. run: on tensors read from a file, writing the outputs to a file.
//   With --train-steps N, a train-step package (mode=training): its output roles come from the signed check
//   (predicate.check.training); the weights blob is the starting parameters and buffers, bound user-managed, so the
//   package reads them live and updates the buffers in place; each step runs the package and applies plain SGD
//   (p -= lr * grad:p) to the bound parameters. The outputs file gets the N losses, then every bound tensor after
//   the last step, in the manifest's constant order.
//
// Tensor files are torch's own serialisation format (a zip holding a pickle and the raw tensor bytes), read and
// written here with torch::jit::pickle_load / pickle_save:
//   inputs:  a list (or tuple) of tensors, torch.save([x, ...], path) in Python: the package's flattened inputs, in
//            the order of the exported program's arguments;
//   outputs: a tuple of CPU tensors, the package's flattened outputs: torch.load(path, weights_only=True).
// The C++ side never runs Python; torch.load(weights_only=True) allows only tensors and containers.
//
// Exit status: 0 ran; 1 an error (unreadable file, load or run failed, no CUDA); 2 bad usage; 3 refused by the
// verification (nothing was loaded).
#include <ATen/ops/tensor.h>  // at::tensor: torch 2.11 reaches it through no other header included here
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "verify.h"
#include "weights.h"

namespace {

constexpr int kExitError = 1, kExitUsage = 2, kExitRefused = 3;
constexpr const char* kUsage = R"(usage: aotc_run --package PKG.pt2 --inputs IN.pt --outputs OUT.pt
                --artifact-key KEY --manifest MANIFEST.json --trusted-key KEY.b64 [--trusted-key ...]
                [--weights W.safetensors] [--signing-keys KEYS.json] [--device cpu|cuda|cuda:N] [--repeat N]
                [--train-steps N [--lr LR]] [--allow-unverified]
       aotc_run --package PKG.pt2 --inputs IN.pt --outputs OUT.pt --insecure-skip-verify [...]

Verifies PKG.pt2 against its signed manifest (GET /v1/artifacts/KEY/manifest) and pinned public keys (raw
32-byte Ed25519 keys in base64, as GET /v1/signing-keys lists them; KEYS.json, that answer saved, adds the
service's revocations), then loads it with AOTIModelPackageLoader and runs it on the tensors in IN.pt
(torch.save([x, ...])), writing a tuple of outputs to OUT.pt (torch.load(OUT.pt, weights_only=True)).
A weightless package (its manifest names a weights blob) needs --weights: the blob (GET /v1/artifacts/KEY/weights,
or NAME.weights.safetensors beside what aotc pull wrote), verified against the manifest and bound at load.
--device cuda needs a program built against a CUDA torch wheel and a CUDA package.
--train-steps N runs a train-step package (mode=training) N times on IN.pt's batch, SGD at --lr (default 0.05) on
the weights blob's parameters between steps; OUT.pt gets (losses[N], every bound tensor after the last step).
A package its builder signed as not run on its target (built for another architecture or level) is refused, as
the Python SDK refuses one no trusted key countersigned; this loader reads no countersignature, so
--allow-unverified takes it anyway.
Exit status: 0 ran, 1 error, 2 usage, 3 refused (nothing loaded).
)";

struct Args {
  std::string package, inputs, outputs, artifact_key, manifest, signing_keys, weights, device = "cpu";
  std::vector<std::string> trusted_keys;
  bool skip_verify = false;
  bool allow_unverified = false;
  int repeat = 0;
  int train_steps = 0;
  double lr = 0.05;
};

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (flag == "--insecure-skip-verify") {
      a.skip_verify = true;
      continue;
    }
    if (flag == "--allow-unverified") {
      a.allow_unverified = true;
      continue;
    }
    if (i + 1 >= argc) throw UsageError(flag + " needs a value");
    std::string value = argv[++i];
    if (flag == "--package") a.package = value;
    else if (flag == "--inputs") a.inputs = value;
    else if (flag == "--outputs") a.outputs = value;
    else if (flag == "--artifact-key") a.artifact_key = value;
    else if (flag == "--manifest") a.manifest = value;
    else if (flag == "--trusted-key") a.trusted_keys.push_back(value);
    else if (flag == "--signing-keys") a.signing_keys = value;
    else if (flag == "--weights") a.weights = value;
    else if (flag == "--device") a.device = value;
    else if (flag == "--repeat") {
      try {
        a.repeat = std::stoi(value);
      } catch (const std::exception&) {
        a.repeat = -1;
      }
      if (a.repeat < 0) throw UsageError("--repeat takes a count >= 0");
    } else if (flag == "--train-steps") {
      try {
        a.train_steps = std::stoi(value);
      } catch (const std::exception&) {
        a.train_steps = -1;
      }
      if (a.train_steps < 1 || a.train_steps > 100000) throw UsageError("--train-steps takes a count 1..100000");
    } else if (flag == "--lr") {
      try {
        a.lr = std::stod(value);
      } catch (const std::exception&) {
        throw UsageError("--lr takes a number");
      }
    } else {
      throw UsageError("unknown argument " + flag);
    }
  }
  if (a.package.empty() || a.inputs.empty() || a.outputs.empty())
    throw UsageError("--package, --inputs and --outputs are required");
  if (!a.skip_verify && (a.artifact_key.empty() || a.manifest.empty() || a.trusted_keys.empty()))
    throw UsageError("--artifact-key, --manifest and --trusted-key are required (or --insecure-skip-verify)");
  if (a.skip_verify && (!a.manifest.empty() || !a.trusted_keys.empty() || !a.signing_keys.empty()))
    throw UsageError("--insecure-skip-verify with --manifest, --trusted-key or --signing-keys: pick one");
  if (a.train_steps > 0 && (a.skip_verify || a.weights.empty()))
    throw UsageError("--train-steps needs the signed manifest (the output roles are in it) and --weights (the "
                     "starting parameters)");
  return a;
}

// Where the tensors go: cpu, or a CUDA device this process can use. Fails with the reason before anything is read.
c10::Device pick_device(const std::string& spec) {
  if (spec == "cpu") return c10::Device(c10::kCPU);
  if (spec != "cuda" && spec.rfind("cuda:", 0) != 0) throw UsageError("--device is cpu, cuda or cuda:N, not " + spec);
  c10::DeviceIndex index = 0;
  if (spec.size() > 5) {
    std::string n = spec.substr(5);
    if (n.empty() || n.size() > 2 || n.find_first_not_of("0123456789") != std::string::npos)
      throw UsageError("--device cuda:N takes a device number, not " + spec);
    index = static_cast<c10::DeviceIndex>(std::stoi(n));
  }
#ifndef AOTC_WITH_CUDA
  (void)index;
  throw std::runtime_error("--device " + spec + ": this program was built against a libtorch without CUDA (torch " +
                           TORCH_VERSION + ", no libtorch_cuda.so); build it against a CUDA torch wheel");
#else
  if (!torch::cuda::is_available())
    throw std::runtime_error("--device " + spec + ": no CUDA device is visible to this process (torch " +
                             TORCH_VERSION + " has CUDA; check the driver and CUDA_VISIBLE_DEVICES)");
  if (index >= static_cast<c10::DeviceIndex>(torch::cuda::device_count()))
    throw std::runtime_error("--device " + spec + ": only " + std::to_string(torch::cuda::device_count()) +
                             " CUDA device(s) are visible");
  return c10::Device(c10::kCUDA, index);
#endif
}

std::vector<at::Tensor> read_tensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read inputs " + path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  c10::IValue v = torch::jit::pickle_load(bytes);
  std::vector<at::Tensor> out;
  if (v.isTensor()) {
    out.push_back(v.toTensor());
  } else if (v.isList() || v.isTuple()) {
    auto items = v.isList() ? v.toListRef().vec() : v.toTupleRef().elements().vec();
    for (const auto& item : items) {
      if (!item.isTensor()) throw std::runtime_error(path + " holds a " + item.tagKind() + ", not only tensors");
      out.push_back(item.toTensor());
    }
  } else {
    throw std::runtime_error(path + " holds a " + v.tagKind() + "; expected a list of tensors (torch.save([x, ...]))");
  }
  return out;
}

void write_tensors(const std::string& path, const std::vector<at::Tensor>& tensors) {
  // A tuple: the pickler writes a c10::List with a type tag (torch.jit._pickle.build_tensorlist or
  // restore_type_tag) that torch.load(weights_only=True) refuses; a tuple it writes as a plain pickle tuple.
  std::vector<c10::IValue> items;
  for (const auto& t : tensors) items.emplace_back(t.to(c10::kCPU).contiguous());
  std::vector<char> bytes = torch::jit::pickle_save(c10::IValue(c10::ivalue::Tuple::create(std::move(items))));
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f.flush()) throw std::runtime_error("cannot write outputs " + path);
}

std::string describe(const at::Tensor& t) {
  std::string s = std::string(c10::toString(t.scalar_type())) + "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// A private directory (mode 0700) for the verified copy of the package, removed with it on the way out. Plain POSIX,
// not std::filesystem: libtorch_cpu.so exports its own build's std::filesystem (142 symbols in torch 2.13), and as it
// comes before libstdc++ in the search order our calls bind to those. With torch 2.11+cu130 and Ubuntu's g++ 13 that
// crashed (SIGSEGV in PrivateDir's std::filesystem::remove_all, on the GPU machine).
struct PrivateDir {
  std::string path, file, weights;
  PrivateDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/aotc_run-XXXXXX";
    if (!mkdtemp(tmpl.data())) throw std::runtime_error("cannot create a private directory " + tmpl);
    path = tmpl;
    file = path + "/package.pt2";
    weights = path + "/weights.safetensors";
  }
  ~PrivateDir() {
    ::unlink(file.c_str());
    ::unlink(weights.c_str());
    ::rmdir(path.c_str());
  }
};

// --train-steps: the package's step, then SGD on the bound parameters, N times. The roles are the signed check's;
// the package writes the mutated buffers (BatchNorm's statistics) into the bound tensors itself.
template <typename Sync>
int train(const Args& args, torch::inductor::AOTIModelPackageLoader& loader,
          std::unordered_map<std::string, at::Tensor>& weights, const aotc::Expected& want,
          const std::vector<at::Tensor>& inputs, Sync sync) {
  std::size_t loss_index = want.train_roles.size();
  std::vector<std::pair<at::Tensor, std::size_t>> params;  // (bound parameter, index of its gradient)
  for (const auto& [role, index] : want.train_roles) {
    if (role == "loss") loss_index = index;
    if (role.rfind("grad:", 0) != 0) continue;
    auto it = weights.find(role.substr(5));
    if (it == weights.end()) throw aotc::Refused("signed role " + role + " names no constant of the weights blob");
    params.emplace_back(it->second, index);
  }
  if (loss_index == want.train_roles.size()) throw aotc::Refused("the signed roles name no loss");
  std::vector<double> losses;
  auto t0 = std::chrono::steady_clock::now();
  for (int step = 0; step < args.train_steps; ++step) {
    std::vector<at::Tensor> outputs = loader.run(inputs);
    if (outputs.size() != want.train_roles.size())
      throw std::runtime_error("the package returned " + std::to_string(outputs.size()) + " outputs; its signed "
                               "roles are " + std::to_string(want.train_roles.size()));
    for (auto& [p, index] : params) p.sub_(outputs[index].to(p.scalar_type()), args.lr);
    losses.push_back(outputs[loss_index].to(c10::kCPU).item<double>());
    std::printf("step %d: loss %.6f\n", step + 1, losses.back());
  }
  sync();
  std::printf("%d train steps (SGD lr=%g on %zu parameters) in %.1f ms\n", args.train_steps, args.lr, params.size(),
              ms_since(t0));
  std::vector<at::Tensor> out{at::tensor(losses, at::kDouble)};
  // Copies: the bound tensors are views of one storage (the blob read whole), which the pickler would write once,
  // as the first view's dtype.
  for (const auto& c : want.constants) out.push_back(weights.at(c.fqn).clone());
  write_tensors(args.outputs, out);
  std::printf("wrote %zu losses and %zu tensors to %s\n", losses.size(), want.constants.size(), args.outputs.c_str());
  return 0;
}

int run(const Args& args) {
  const c10::Device device = pick_device(args.device);
  PrivateDir dir;
  const std::string& package = dir.file;

  auto t0 = std::chrono::steady_clock::now();
  aotc::Expected want;
  if (args.skip_verify) {
    std::cerr << "aotc_run: WARNING: --insecure-skip-verify: loading " << args.package
              << " without checking its signature or digest\n";
    aotc::copy_and_hash(args.package, package);
    if (!args.weights.empty()) aotc::copy_and_hash(args.weights, dir.weights);
  } else {
    std::vector<aotc::TrustedKey> keys;
    for (const auto& k : args.trusted_keys) keys.push_back(aotc::read_trusted_key(k));
    std::vector<std::string> revoked;
    if (!args.signing_keys.empty()) revoked = aotc::read_revoked(args.signing_keys);
    want = aotc::verify_manifest(aotc::read_file(args.manifest, 16 << 20), keys, revoked, args.artifact_key);
    if (!want.run_on_target && !args.allow_unverified)
      throw aotc::Refused("unverified on target: artifact " + want.artifact_key + " was built for " + want.target +
                          " without being run there, and this loader reads no countersignature of a check on "
                          "it: pull it with the Python SDK (which checks one), or pass --allow-unverified");
    if (!want.run_on_target)
      std::cerr << "aotc_run: WARNING: --allow-unverified: loading " << want.artifact_key << ", built for "
                << want.target << " without being run there\n";
    aotc::Digest got = aotc::copy_and_hash(args.package, package);
    aotc::check_package(got, want, args.package);
    if (want.weights_sha256.empty() != args.weights.empty())
      throw aotc::Refused(want.weights_sha256.empty()
                              ? "--weights given, but the manifest says the package carries its own weights"
                              : "the package binds its weights at load: pass its weights blob (sha256 " +
                                    want.weights_sha256 + ") with --weights (GET /v1/artifacts/" +
                                    want.artifact_key + "/weights)");
    if (!args.weights.empty()) aotc::check_weights(aotc::copy_and_hash(args.weights, dir.weights), want, args.weights);
    std::printf("verified %s: signed by key %s, %llu bytes, sha256 %s (%.1f ms)\n", want.artifact_key.c_str(),
                want.keyid.c_str(), static_cast<unsigned long long>(want.size), want.sha256.c_str(), ms_since(t0));
    if (!args.weights.empty())
      std::printf("verified weights: %llu bytes, sha256 %s, %zu constants\n",
                  static_cast<unsigned long long>(want.weights_size), want.weights_sha256.c_str(),
                  want.constants.size());
  }

  // The package says which device it was compiled for; a mismatch would otherwise fail deep inside the runner.
  auto meta = torch::inductor::AOTIModelPackageLoader::load_metadata_from_package(package, "model");
  const std::string compiled_for = meta.count("AOTI_DEVICE_KEY") ? meta["AOTI_DEVICE_KEY"] : "cpu";
  if (compiled_for != c10::DeviceTypeName(device.type(), /*lower_case=*/true))
    throw std::runtime_error("the package is compiled for " + compiled_for + "; --device " + args.device +
                             " cannot run it");

  std::vector<at::Tensor> inputs = read_tensors(args.inputs);
  for (auto& t : inputs) t = t.to(device);

  c10::InferenceMode no_autograd;
  t0 = std::chrono::steady_clock::now();
  torch::inductor::AOTIModelPackageLoader loader(package, "model", /*run_single_threaded=*/false,
                                                 /*num_runners=*/1,
                                                 device.is_cuda() ? device.index() : c10::DeviceIndex(-1));
  std::printf("loaded with AOTIModelPackageLoader (torch %s, %s) in %.1f ms\n", TORCH_VERSION,
              device.str().c_str(), ms_since(t0));
  // Kept alive as long as the loader: user-managed constants are the package's only copy of the weights.
  std::unordered_map<std::string, at::Tensor> weights;
  if (!args.weights.empty()) {
    t0 = std::chrono::steady_clock::now();
    weights = aotc::load_weights(dir.weights, want, device);
    loader.load_constants(weights, /*use_inactive=*/false, /*check_full_update=*/true, /*user_managed=*/true);
    std::printf("bound %zu weights in %.1f ms\n", weights.size(), ms_since(t0));
  }

  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  };
  if (!want.train_roles.empty() && args.train_steps == 0)
    throw std::runtime_error("the package is a train step (mode=training): run it with --train-steps N");
  if (args.train_steps > 0) {
    if (want.train_roles.empty())
      throw std::runtime_error("--train-steps: the manifest's check has no training roles: not a train-step package");
    return train(args, loader, weights, want, inputs, sync);
  }
  t0 = std::chrono::steady_clock::now();
  std::vector<at::Tensor> outputs = loader.run(inputs);
  sync();
  double first = ms_since(t0);
  std::string shapes;
  for (const auto& t : inputs) shapes += (shapes.empty() ? "" : ", ") + describe(t);
  std::printf("ran on %s -> ", shapes.c_str());
  shapes.clear();
  for (const auto& t : outputs) shapes += (shapes.empty() ? "" : ", ") + describe(t);
  std::printf("%s: first call %.2f ms\n", shapes.c_str(), first);

  if (args.repeat > 0) {
    std::vector<double> times;
    for (int i = 0; i < args.repeat; ++i) {
      t0 = std::chrono::steady_clock::now();
      loader.run(inputs);
      sync();
      times.push_back(ms_since(t0));
    }
    std::sort(times.begin(), times.end());
    std::printf("%d more calls: median %.3f ms, min %.3f ms\n", args.repeat, times[times.size() / 2], times[0]);
  }

  write_tensors(args.outputs, outputs);
  std::printf("wrote %zu output(s) to %s\n", outputs.size(), args.outputs.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse_args(argc, argv);
    return run(args);
  } catch (const UsageError& e) {
    std::cerr << "aotc_run: " << e.what() << "\n\n" << kUsage;
    return kExitUsage;
  } catch (const aotc::Refused& e) {
    std::cerr << "aotc_run: refused " << (args.package.empty() ? "the package" : args.package) << ": " << e.what()
              << "\n";
    return kExitRefused;
  } catch (const c10::Error& e) {
    std::cerr << "aotc_run: error: " << e.what_without_backtrace() << "\n";
    return kExitError;
  } catch (const std::exception& e) {
    // Errors raised inside the package's code reach here as text with a C++ backtrace appended: keep the message.
    std::string what = e.what();
    what = what.substr(0, what.find("\nException raised from"));
    std::cerr << "aotc_run: error: " << what << "\n";
    return kExitError;
  }
}
