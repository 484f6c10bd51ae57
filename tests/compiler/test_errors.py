"""What a failed compile tells its user (compiler.errors.described): a C++ compile error of the generated code leads
with the compiler's error lines, not the command that torch's message puts first."""

from __future__ import annotations

from torch._inductor.exc import CppCompileError, InductorError

from compiler.errors import described

# torch 2.13's CPU build of LeViT-128's bf16 train step (bench/README.md): one of its kernels declares an
# accumulator twice. The output as g++ wrote it, shortened.
OUTPUT = """/tmp/torchinductor_root/c7/coh3.kernel.cpp: In function 'void cpp_fused__native_batch_norm_39(float*)':
/tmp/torchinductor_root/c7/coh3.kernel.cpp:20298:30: error: conflicting declaration 'auto at_BFloat16_tmp_acc0_vec'
20298 |                         auto at_BFloat16_tmp_acc0_vec = at::vec::Vectorized<float>(0);
/tmp/torchinductor_root/c7/coh3.kernel.cpp:20305:30: error: conflicting declaration 'auto at_BFloat16_tmp_acc0_vec'
/tmp/torchinductor_root/c7/coh3.kernel.cpp:20305:30: error: conflicting declaration 'auto at_BFloat16_tmp_acc0_vec'
"""


def test_a_cpp_compile_error_leads_with_the_compilers_error_lines():
    command = ["g++", "/tmp/torchinductor_root/c7/coh3.kernel.cpp", *["-I/opt/include/torch"] * 300, "-o", "k.so"]
    try:
        try:
            raise CppCompileError(command, OUTPUT)
        except CppCompileError as inner:
            raise InductorError(inner, None) from inner
    except InductorError as e:
        assert len(str(e)) > 4000 and str(e).index(": error: ") > 4000  # the job's capped message never got there
        message, excerpt = described(e)
    assert message == ("InductorError: C++ compile error in the generated code: coh3.kernel.cpp:20298:30: error: "
                       "conflicting declaration 'auto at_BFloat16_tmp_acc0_vec'; coh3.kernel.cpp:20305:30: error: "
                       "conflicting declaration 'auto at_BFloat16_tmp_acc0_vec'")
    assert excerpt == OUTPUT

    # A long output (LeViT's was over 94,000 characters before its first error): the excerpt is each error line
    # with the three after it.
    notes = "".join(f"k.cpp:{n}:1: note: candidate\n" for n in range(3000))
    long = CppCompileError(command, notes + "k.cpp:9:9: error: one\n  9 | code\n    | ^\nk.cpp: more\nk.cpp: after\n")
    message, excerpt = described(long)
    assert message.endswith("k.cpp:9:9: error: one")
    assert excerpt == "k.cpp:9:9: error: one\n  9 | code\n    | ^\nk.cpp: more"
    message, excerpt = described(CppCompileError(command, "y" * 20_000))
    assert len(excerpt) == 8004 and excerpt.startswith("...\n")


def test_any_other_failure_keeps_its_own_message():
    assert described(ValueError("the shapes disagree")) == ("ValueError: the shapes disagree", "")
    message, excerpt = described(CppCompileError(["g++"], "ld: cannot find -lfoo"))
    assert message.endswith("no line says error (the output is in the excerpt)") and excerpt == "ld: cannot find -lfoo"
