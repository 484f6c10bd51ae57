"""One error tree for aotc. Torch-free: the API, the worker, the compiler and the client all import it.

    AotcError                      status, code, message: a request the API refuses
     ├── BadRequest        400     malformed request that is not a validation error
     ├── NotFound          404     unknown model, job or artifact
     ├── Conflict          409     e.g. cancelling a job that already ended
     ├── PayloadTooLarge   413     upload over the size limit
     ├── UnsupportedMedia  415     upload that is not a zip
     ├── Unprocessable     422     a spec or an archive that contradicts the exported program
     │    └── UnsafeArchive        an archive that holds what a normal model never needs
     └── Unavailable       503     no live worker for a target; Redis down

    CompileError                   stage, message, excerpt, retryable: a compile or check that failed
     ├── UnsafeModel               an archive whose pickled parts would not load with weights_only=True
     ├── BadModel                  not an exported program torch can read, or one this service refuses
     ├── SpecError                 the requested shapes contradict the exported program
     └── CheckFailed               the artifact ran but disagrees with eager beyond tolerance

Every message says what was wrong and, where it can, what would be right: a user's mistake is never a 500.
A CompileError on a valid model is permanent (retryable=False): retrying gives the same answer. Crashes,
timeouts and lost workers are not exceptions but failure records, classified by the worker.
"""

from __future__ import annotations

from typing import Any


class AotcError(Exception):
    status = 500
    code = "internal"

    def __init__(self, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail

    def to_json(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, **self.detail}}


class BadRequest(AotcError):
    status, code = 400, "bad_request"


class NotFound(AotcError):
    status, code = 404, "not_found"


class Conflict(AotcError):
    status, code = 409, "conflict"


class PayloadTooLarge(AotcError):
    status, code = 413, "too_large"


class UnsupportedMedia(AotcError):
    status, code = 415, "not_a_zip"


class Unprocessable(AotcError):
    status, code = 422, "invalid"


class UnsafeArchive(Unprocessable):
    code = "unsafe_archive"


class Unavailable(AotcError):
    status, code = 503, "unavailable"


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
