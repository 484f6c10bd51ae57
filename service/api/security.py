"""The API's security scheme as the OpenAPI declares it: an HTTP bearer token (an aotc API key)."""

from __future__ import annotations

from fastapi.security import HTTPBearer

# auto_error=False: service.api.auth answers a missing key itself (401 with a JSON body that says what to do, or
# nothing at all in open mode), instead of FastAPI's bare 403.
bearer_scheme = HTTPBearer(
    auto_error=False, scheme_name="bearer", bearerFormat="aotc API key",
    description="An aotc API key: `Authorization: Bearer aotc_<id>_<secret>` (the CLI and SDK read AOTC_API_KEY).",
)
