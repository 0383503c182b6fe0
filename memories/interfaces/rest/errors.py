"""Every REST error as `{"error": {"code", "message", ...}}`, with the MCP codes."""

import logging

from django.core.exceptions import RequestDataTooBig, SuspiciousOperation, TooManyFieldsSent, TooManyFilesSent
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from audit.services import auth_failure_record
from core.calls import call_context_from_request
from core.choices import Channel
from core.errors import ErrorCode, ServiceError

logger = logging.getLogger(__name__)

_DRF_CODES = {
    status.HTTP_400_BAD_REQUEST: ErrorCode.INVALID_ARGUMENT,
    status.HTTP_401_UNAUTHORIZED: ErrorCode.UNAUTHENTICATED,
    status.HTTP_403_FORBIDDEN: ErrorCode.UNAUTHENTICATED,
    status.HTTP_404_NOT_FOUND: ErrorCode.NOT_FOUND,
    status.HTTP_405_METHOD_NOT_ALLOWED: ErrorCode.INVALID_ARGUMENT,
    status.HTTP_406_NOT_ACCEPTABLE: ErrorCode.INVALID_ARGUMENT,
    status.HTTP_413_REQUEST_ENTITY_TOO_LARGE: ErrorCode.PAYLOAD_TOO_LARGE,
    status.HTTP_415_UNSUPPORTED_MEDIA_TYPE: ErrorCode.INVALID_ARGUMENT,
    status.HTTP_429_TOO_MANY_REQUESTS: ErrorCode.RATE_LIMITED,
}


def service_error_response(exc: ServiceError) -> Response:
    response = Response({"error": exc.as_dict()}, status=exc.http_status)
    if exc.retry_after_s is not None:
        response["Retry-After"] = str(exc.retry_after_s)
    return response


def exception_handler(exc, context):
    if isinstance(exc, ServiceError):
        return service_error_response(exc)
    if isinstance(exc, SuspiciousOperation):
        # Django's own request limits, met while DRF reads the query string or a form
        # (more than DATA_UPLOAD_MAX_NUMBER_FIELDS parameters, too many files): before
        # authentication, so answered like a malformed request, with our codes.
        return service_error_response(_suspicious_request_error(exc))
    response = drf_exception_handler(exc, context)
    if response is None:
        return None  # unexpected: Django logs it and answers 500 without details
    code = _DRF_CODES.get(response.status_code, ErrorCode.INVALID_ARGUMENT)
    if isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed):
        message = "A valid bearer token is required."
        _count_auth_failure(context.get("request"))
    else:
        detail = getattr(exc, "detail", None)
        message = detail if isinstance(detail, str) else "The request was not valid."
    response.data = {"error": {"code": code.value, "message": str(message)}}
    return response


def _suspicious_request_error(exc: SuspiciousOperation) -> ServiceError:
    if isinstance(exc, RequestDataTooBig):
        return ServiceError(ErrorCode.PAYLOAD_TOO_LARGE, "The request body is too large.")
    if isinstance(exc, TooManyFieldsSent | TooManyFilesSent):
        return ServiceError(ErrorCode.INVALID_ARGUMENT, "The request has too many parameters, fields or files.")
    return ServiceError(ErrorCode.INVALID_ARGUMENT, "The request was not valid.")


def _count_auth_failure(request) -> None:
    if request is None:
        return
    try:
        auth_failure_record(
            call=call_context_from_request(request, channel=Channel.REST),
            credential_presented=bool(request.META.get("HTTP_AUTHORIZATION")),
        )
    except Exception:  # counting must never turn a 401 into a 500
        logger.warning("could not count an unauthenticated request", exc_info=True)
