"""Errors the API turns into HTTP answers.

    AotcError                      status, code, message
     ├── BadRequest        400     malformed request that is not a validation error
     ├── NotFound          404     unknown model, job or artifact
     ├── Conflict          409     e.g. cancelling a job that already ended
     ├── PayloadTooLarge   413     upload over the size limit
     ├── UnsupportedMedia  415     upload that is not a zip
     ├── Unprocessable     422     a spec or an archive that contradicts the exported program
     │    └── UnsafeArchive        an archive whose pickles name globals outside the allow-list
     └── Unavailable       503     no live worker for a target; Redis down

Every message says what was wrong and, where it can, what would be right: a user's mistake is never a 500.
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
