"""The REST body parser: DRF's JSONParser recurses (a body nested 100,000 deep raised
RecursionError, a 500) and accepts NaN and Infinity. This one reads at most
MAX_BODY_BYTES and parses with core.inputs.json_loads_safe."""

from __future__ import annotations

from rest_framework import exceptions
from rest_framework.parsers import JSONParser

from core.inputs import InputError, json_loads_safe

MAX_BODY_BYTES = 256 * 1024  # the MCP endpoint's limit too


class BodyTooLarge(exceptions.APIException):
    status_code = 413
    default_detail = f"The request body exceeds {MAX_BODY_BYTES} bytes."
    default_code = "payload_too_large"


class SafeJSONParser(JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        data = stream.read(MAX_BODY_BYTES + 1) if stream is not None else b""
        if len(data) > MAX_BODY_BYTES:
            raise BodyTooLarge()
        try:
            return json_loads_safe(data)
        except InputError as exc:
            if exc.too_large:
                raise BodyTooLarge(exc.message) from None
            raise exceptions.ParseError(f"The body is not acceptable JSON: {exc.message}") from None
