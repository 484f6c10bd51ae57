"""Errors raised by the compiler pipeline.

    CompileError                 stage, message, excerpt, retryable
     ├── UnsafeModel             an archive whose pickled parts would not load with weights_only=True
     ├── BadModel                not an exported program torch can read, or one this service refuses
     ├── SpecError               the requested shapes contradict the exported program
     ├── CheckFailed             the artifact ran but disagrees with eager beyond tolerance
     └── ToolchainMismatch       the job was keyed for another toolchain than this worker runs

A CompileError on a valid model is permanent (retryable=False): retrying gives the same answer.
Crashes, timeouts and lost workers are classified by the worker, not here.
"""

from __future__ import annotations


class CompileError(Exception):
    retryable = False

    def __init__(self, message: str, *, stage: str = "", excerpt: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.stage = stage
        self.excerpt = excerpt

    def to_json(self) -> dict[str, object]:
        return {
            "type": type(self).__name__,
            "message": self.message,
            "stage": self.stage,
            "excerpt": self.excerpt,
            "retryable": self.retryable,
        }


class UnsafeModel(CompileError):
    pass


class BadModel(CompileError):
    pass


class SpecError(CompileError):
    pass


class CheckFailed(CompileError):
    pass


class ToolchainMismatch(CompileError):
    pass
