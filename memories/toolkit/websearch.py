"""search_web's provider, pluggable: Tavily first. Off unless its key is set; the
endpoint is a setting so tests point it at a fake on loopback. Keys never reach logs
or error messages; results are returned to the agent, never stored."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import httpx
from django.conf import settings

from core.http_deadline import ResponseTooLarge, deadline_client

logger = logging.getLogger(__name__)

# A few results of a few KB each; a body past this is not an answer worth waiting for.
MAX_RESPONSE_BYTES = 2 * 1024 * 1024


class WebSearchUnavailable(Exception):
    """The provider failed; the message is safe to show (no key, no response body)."""


class WebSearchProvider(Protocol):
    name: str

    def search(self, query: str, *, max_results: int) -> list[dict[str, str]]: ...


class TavilyProvider:
    name = "tavily"

    def __init__(self, *, api_key: str, endpoint: str, timeout_s: float):
        self._api_key = api_key
        self._endpoint = endpoint
        self._timeout_s = timeout_s

    def search(self, query: str, *, max_results: int) -> list[dict[str, str]]:
        try:
            # WEB_SEARCH_TIMEOUT_S bounds the whole request: a provider that drips its
            # answer would otherwise hold this tool call (and its worker thread) for ever.
            with deadline_client(total_s=self._timeout_s, max_bytes=MAX_RESPONSE_BYTES) as client:
                response = client.post(
                    self._endpoint,
                    json={"query": query, "max_results": max_results, "search_depth": "basic"},
                    headers={"Authorization": f"Bearer {self._api_key}"},
                )
        except ResponseTooLarge:
            logger.warning("web search provider answered more than %d bytes", MAX_RESPONSE_BYTES)
            raise WebSearchUnavailable("the provider's answer could not be read") from None
        except httpx.HTTPError as exc:
            logger.warning("web search request failed: %s", type(exc).__name__)
            raise WebSearchUnavailable("the provider could not be reached") from None
        if response.status_code != 200:
            logger.warning("web search provider answered HTTP %s", response.status_code)
            raise WebSearchUnavailable(f"the provider answered HTTP {response.status_code}")
        try:
            body: Any = response.json()
            items = body.get("results") or []
            if not isinstance(items, list):  # slicing an object raised TypeError: a 500
                raise WebSearchUnavailable("the provider's answer could not be read")
            return [
                {
                    "title": str(i.get("title") or ""),
                    "url": str(i.get("url") or ""),
                    "content": str(i.get("content") or ""),
                }
                for i in items[:max_results]
                if isinstance(i, dict)
            ]
        except (ValueError, AttributeError):
            raise WebSearchUnavailable("the provider's answer could not be read") from None


def web_search_provider() -> WebSearchProvider | None:
    """The configured provider, or None when web search is off (no key)."""
    if settings.WEB_SEARCH_PROVIDER == "tavily" and settings.TAVILY_API_KEY:
        return TavilyProvider(
            api_key=settings.TAVILY_API_KEY, endpoint=settings.TAVILY_ENDPOINT, timeout_s=settings.WEB_SEARCH_TIMEOUT_S
        )
    return None
