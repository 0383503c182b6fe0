"""The web UI in real headless Chromium (Debian's chromium + chromedriver, installed by
.ci/run), against the live server. Saves a screenshot of each page to docs/screenshots/."""

from __future__ import annotations

import os
import shutil

import pytest

from core.scope import MemoryScope
from memories.engine.retrieval import hybrid_search
from memories.services import memory_remember
from tests.conftest import age_memory, internal_call, wait_for
from tests.engine_helpers import memory_gone
from tests.environment import ROOT

pytestmark = pytest.mark.slow
SCREENSHOTS = ROOT / "docs" / "screenshots"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")

if not (CHROMIUM and CHROMEDRIVER):
    if os.environ.get("CI"):
        raise RuntimeError("CI needs Debian's chromium and chromium-driver (.ci/run installs them)")
    pytest.skip(
        "chromium/chromedriver not installed (apt-get install chromium chromium-driver)", allow_module_level=True
    )


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-quic", "--no-first-run",
        "--disable-dev-shm-usage", "--disable-features=Translate,MediaRouter,OptimizationHints",
        f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1280,1000",
    ):  # fmt: skip
        options.add_argument(flag)
    # Downloads (the Your data page's forms) land in the test's own directory, unasked.
    options.add_experimental_option(
        "prefs", {"download.default_directory": str(tmp_path / "downloads"), "download.prompt_for_download": False}
    )
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.implicitly_wait(5)
    yield driver
    driver.quit()


class Page:
    def __init__(self, driver, base_url: str):
        self.driver, self.base = driver, base_url

    def open(self, path: str) -> None:
        self.driver.get(self.base + path)

    def find(self, css: str):
        from selenium.webdriver.common.by import By

        return self._retry(lambda: self.driver.find_element(By.CSS_SELECTOR, css))

    @staticmethod
    def _retry(action, attempts: int = 5):
        """Chromium can hand out a node of the page it is just replacing; ask again."""
        import time

        from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

        for attempt in range(attempts):
            try:
                return action()
            except (StaleElementReferenceException, WebDriverException) as exc:
                if (
                    attempt == attempts - 1
                    or "does not belong to the document" not in str(exc)
                    and not isinstance(exc, StaleElementReferenceException)
                ):
                    raise
                time.sleep(0.2)

    def fill(self, css: str, text: str) -> None:
        def fill_once():
            field = self.find(css)
            field.clear()
            field.send_keys(text)

        self._retry(fill_once)

    def _navigating(self, element) -> None:  # element: a callable finding it
        """Click something that loads a new page, and wait until it has."""
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        old = self._retry(lambda: self.driver.find_element(By.TAG_NAME, "html"))
        self._retry(lambda: element().click())
        WebDriverWait(self.driver, 15).until(lambda _: self._gone(old))

    @staticmethod
    def _gone(element) -> bool:
        """True once `element` belongs to a replaced document. Chromium reports that as
        a stale element or as a node that no longer belongs to the document."""
        from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

        try:
            element.is_enabled()
        except StaleElementReferenceException:
            return True
        except WebDriverException as exc:
            if "does not belong to the document" in str(exc):
                return True
            raise
        return False

    def click(self, css: str) -> None:
        self._navigating(lambda: self.find(css))

    def click_text(self, text: str) -> None:
        from selenium.webdriver.common.by import By

        xpath = f"//*[self::a or self::button][normalize-space()='{text}']"
        self._navigating(lambda: self.driver.find_element(By.XPATH, xpath))

    def text_of(self, css: str) -> str:
        return self._retry(lambda: self.find(css).text)

    @property
    def text(self) -> str:
        return self._retry(lambda: self.find("main").text)

    def shot(self, name: str) -> None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        height = self.driver.execute_script("return document.documentElement.scrollHeight")
        width = self.driver.get_window_size()["width"]
        self.driver.set_window_size(width, max(600, min(height + 140, 2400)))
        self.driver.save_screenshot(str(SCREENSHOTS / f"{name}.png"))


def test_browse_search_pin_edit_delete_and_keys(browser, memsite_server, alice, mcp_as):
    scope = MemoryScope.for_user(alice)
    facts = [
        "I bake sourdough bread every Sunday",
        "My daughter Mia is allergic to peanuts",
        "I prefer aisle seats on long flights",
        "Our team standup is at 9:30 on weekdays",
    ]
    ids = {fact: memory_remember(scope, memory=fact, call=internal_call()).id for fact in facts}
    age_memory(ids[facts[0]], 120)
    page = Page(browser, memsite_server)

    page.open("/memories/")
    assert "/accounts/login/" in browser.current_url
    page.shot("01-login")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "alice-password-1")
    page.click("button[type=submit]")
    assert "My memories" in page.text and "Mia is allergic" in page.text
    page.shot("02-memories")

    page.fill("#q", "bread baking")
    page.click("form.filters button[type=submit]")
    assert page.text_of(".memories li .text") == facts[0]
    page.shot("03-search")

    page.click(".memories li .text a")
    page.click_text("Pin")
    assert "Pinned" in page.text_of("h1")
    # Pinned in the UI: search_memory over MCP returns it without recency decay.
    key_holder = {}

    page.fill("#memory", "I bake sourdough bread every Saturday")
    page.click_text("Save changes")
    assert "every Saturday" in page.text_of("main > p:nth-of-type(2)")
    assert "alice (ui)" in page.text
    page.shot("04-memory-detail")

    page.open("/keys/")
    page.fill("#name", "browser-test-agent")
    page.click_text("Create key")
    key = page.text_of("#key-value")
    assert key.startswith("msk_")
    key_holder["key"] = key
    browser.execute_script(
        "for (const id of ['key-value', 'mcp-config']) {"
        " const el = document.getElementById(id); el.textContent = el.textContent.replace(/msk_[A-Za-z0-9_-]+/, "
        "'msk_0123456789ab_EXAMPLE-KEY-SHOWN-ONCE'); }"
    )
    page.shot("05-api-key-created")

    mcp = mcp_as(key_holder["key"])
    found = mcp.ok("search_memory", {"query": "sourdough bread", "top_k": 5})["results"]
    pinned = next(r for r in found if r["id"] == ids[facts[0]])
    assert pinned["pinned"] is True
    raw = next(r for r in hybrid_search(scope, query="sourdough bread", limit=15) if r.id == ids[facts[0]])
    assert pinned["score"] == pytest.approx(raw.score, abs=1e-6)  # no decay, despite 120 days

    page.click_text("Revoke")
    assert "revoked" in page.text
    page.shot("06-api-keys")
    with pytest.raises(Exception):  # noqa: B017 - the SDK client raises on the 401
        mcp_as(key_holder["key"]).call("list_memory", {})

    page.open(f"/memories/{ids[facts[2]]}/")
    page.click_text("Delete…")
    assert "Delete this memory?" in page.text
    page.shot("07-delete-confirmation")
    page.click_text("Delete memory")
    assert "Memory deleted." in page.text and "aisle seats" not in page.text
    assert memory_gone(ids[facts[2]])

    page.open("/usage/")
    assert "search_memory" in page.text
    page.shot("08-usage")
    page.open("/memories/clear/")
    page.shot("09-clear-all")

    browser.set_window_size(390, 844)  # a phone
    page.open("/memories/")
    assert page.find("#q").is_displayed()
    width = browser.execute_script("return document.documentElement.scrollWidth")
    assert width <= 390, f"horizontal scroll on a phone: {width}px"
    page.shot("10-phone")


def test_bob_sees_404_for_alices_memory(browser, memsite_server, alice, bob):
    memory_id = memory_remember(MemoryScope.for_user(alice), memory="Alice's secret", call=internal_call()).id
    page = Page(browser, memsite_server)
    page.open("/accounts/login/")
    page.fill("#id_username", "bob")
    page.fill("#id_password", "bob-password-1")
    page.click("button[type=submit]")
    for path in (f"/memories/{memory_id}/", f"/memories/{memory_id}/delete/"):
        page.open(path)
        assert "Not Found" in browser.page_source or "404" in browser.title
        assert "Alice's secret" not in browser.page_source


def _login(page: Page, username: str) -> None:
    page.open("/accounts/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", f"{username}-password-1")
    page.click("button[type=submit]")


def test_agent_clears_all_then_the_user_restores_everything_in_the_ui(
    browser, memsite_server, alice, alice_key, mcp_as
):
    from datetime import UTC, datetime, timedelta

    from django.conf import settings

    from audit.models import MemoryHistory
    from memories.services import memory_purge_due

    mcp = mcp_as(alice_key)
    facts = ["Alice's bike is a green Brompton", "Alice's sister lives in Porto", "Alice is learning Greek"]
    ids = [mcp.ok("remember", {"memory": fact, "tags": ["life"]})["id"] for fact in facts]
    mcp.ok("update_memory", {"memory_id": ids[0], "memory": "Alice's bike is a red Brompton"})
    history_before = {i: list(MemoryHistory.objects.filter(memory_id=i).values_list("id", flat=True)) for i in ids}
    assert mcp.ok("clear_all_memory", {"confirm": True}) == {"deleted": 3}
    assert mcp.ok("search_memory", {"query": "Brompton bike"})["results"] == []

    page = Page(browser, memsite_server)
    _login(page, "alice")
    assert "No memories" in page.text
    page.open("/trash/")
    assert "3 deleted by clear_all_memory" in page.text and "red Brompton" in page.text
    page.shot("11-trash")
    page.click_text("Restore all 3")
    assert "Restored 3 memories." in page.text and "The trash is empty." in page.text

    found = mcp.ok("search_memory", {"query": "Brompton bike", "top_k": 3})["results"]
    assert found[0]["id"] == ids[0] and found[0]["memory"] == "Alice's bike is a red Brompton"
    assert sorted(m["id"] for m in mcp.ok("list_memory", {"tags": ["life"]})["memories"]) == sorted(ids)
    for memory_id in ids:  # the same history, plus the trip through the trash
        events = list(MemoryHistory.objects.filter(memory_id=memory_id).order_by("recorded_at", "id"))
        assert [e.id for e in events][: len(history_before[memory_id])] == history_before[memory_id]
        assert [e.event for e in events][-2:] == ["DELETE", "RESTORE"]
    page.open(f"/memories/{ids[0]}/")
    assert "restore" in page.text and "alice (ui)" in page.text

    # Bulk forget from the list page (select by tag, see the count, then delete).
    page.open("/memories/?tags=life")
    page.click("#forget-matching")
    assert "Delete 3 matching memories?" in page.text
    page.click_text("Delete 3 memories")
    assert "Moved 3 memories to the trash." in page.text
    # Past the retention window the purge job deletes them for good.
    later = datetime.now(UTC) + timedelta(days=settings.TRASH_RETENTION_DAYS + 1)
    assert memory_purge_due(now=later) == 3
    page.open("/trash/")
    assert "The trash is empty." in page.text
    assert all(memory_gone(i) and engine_row_missing(i) for i in ids)


def engine_row_missing(memory_id: str) -> bool:
    from memories.engine import engine_get

    return engine_get(memory_id) is None


def downloaded(tmp_path, name: str) -> str:
    """The text of a file the browser saved, once it has finished saving it."""
    path = tmp_path / "downloads" / name
    wait_for(lambda: path.exists(), timeout=15, what=f"the download {name}")
    return path.read_text()


def test_the_user_reads_a_session_log_and_curates_cached_answers(browser, memsite_server, alice, bob, tmp_path):
    """What agents keep besides memories, seen and deleted by the person in the UI."""
    from django.db import transaction

    from memories import sessions
    from memories.auth import Principal
    from memories.operations import operation_execute
    from memories.toolkit.models import CacheEntry

    def cache(user, query: str, response: str) -> None:
        principal = Principal(user=user, method="api_key", client_app="travel-agent")
        operation_execute(principal, "store_cache", {"query": query, "response": response}, call=internal_call())

    cache(alice, "Which airline does Alice prefer?", "TAP, aisle seat")
    cache(alice, "When is Alice's flight to Lisbon?", "Friday 9:40 from Gate 12")
    cache(bob, "Bob's question", "bob-private-answer")
    with transaction.atomic():
        sessions.session_events_append(
            MemoryScope.for_user(alice),
            session_id="trip-planning",
            items=[
                {"type": "message", "role": "user", "content": "Book me on the Friday flight to Lisbon"},
                {"type": "message", "role": "assistant", "content": "Done: Friday 9:40, aisle seat."},
            ],
        )

    page = Page(browser, memsite_server)
    _login(page, "alice")
    page.open("/sessions/")
    page.click_text("Read the 2 raw events")
    assert "Book me on the Friday flight to Lisbon" in page.text and "Done: Friday 9:40" in page.text
    page.shot("12-session-log")

    # The downloads are form POSTs (with the CSRF token): the browser saves the files.
    page.open("/data/")
    page.find("#export-session-logs button").click()
    page.find("#export-memories button[value=jsonl]").click()
    logs, memories = downloaded(tmp_path, "session-logs.jsonl"), downloaded(tmp_path, "memories.jsonl")
    assert "Book me on the Friday flight to Lisbon" in logs and "Friday 9:40" in logs
    assert '"count": 0' in memories.splitlines()[0]
    assert "/data/" in browser.current_url  # still on the page: a download, not a navigation

    page.open("/cache/")
    assert "TAP, aisle seat" in page.text and "Gate 12" in page.text and "bob-private-answer" not in page.text
    page.shot("13-cached-answers")
    page.click("button[aria-label^='Delete the cached answer to Which airline']")
    assert "Deleted the cached answer." in page.text and "TAP, aisle seat" not in page.text
    page.click("#clear-cache")
    assert "Deleted 1 cached answer." in page.text and "No cached answers." in page.text
    assert list(CacheEntry.objects.values_list("response", flat=True)) == ["bob-private-answer"]


def test_the_user_pages_through_activity_while_an_agent_works(browser, memsite_server, alice):
    """Older and Newer follow the rows shown, not row numbers: the calls an agent makes
    while the user reads page 1 neither push page 1's rows onto page 2 nor show up there."""
    import re

    from audit.models import AuditEvent

    tenant = MemoryScope.for_user(alice).tenant

    def calls(apps: list[str]) -> None:
        AuditEvent.objects.bulk_create(
            AuditEvent(request_id="r", channel="mcp", operation="remember", outcome="ok", actor_user_id=alice.pk,
                       actor_username="alice", actor_client_app=app, tenant=tenant, subject_user_id=alice.pk)
            for app in apps
        )  # fmt: skip

    calls([f"app-{n}" for n in range(203)])  # a page holds 200
    page = Page(browser, memsite_server)
    _login(page, "alice")
    page.open("/activity/")

    def shown() -> list[str]:
        return re.findall(r"you \((app-\d+)\)", page.text_of("#activity"))

    newest_first = [f"app-{n}" for n in reversed(range(203))]
    first = shown()  # (the newest row of a page may be the sign-in's)
    assert first == newest_first[: len(first)] and len(first) >= 199
    calls([f"app-new-{n}" for n in range(5)])  # the agent goes on
    page.click("a[rel=next]")  # "Older"
    assert shown() == newest_first[len(first) :]
    page.click("a[rel=prev]")  # "Newer"
    assert shown() == first and "Newer" in page.text  # the agent's new calls are newer still
