"""The operators' console in a real headless Chromium, against real consumer,
outbox worker and dashboard processes: an operator finds a mismatched event,
dry-runs it, has the order fixed, replays it and sees the fulfilment delivered.

Set PAYHOOK_SCREENSHOTS=docs/console to refresh the manual's pictures.
"""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
import pytest
from redis import Redis
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from payhook.db import Row
from payhook.queue import enqueue_event, events_queue
from payhook.settings import Settings
from tests.e2e.stack import free_port
from tests.e2e.test_dashboard_browser import PASSWORD, USER, _answers
from tests.factories import LOCAL_RECEIVER_SETTINGS, Factory, StandardEvent
from tests.processes import process_env, start, stop, wait_until
from tests.receiver import Receiver

SCREENSHOTS = os.environ.get("PAYHOOK_SCREENSHOTS")
#: A phone's window, in CSS pixels.
PHONE = (390, 844)

pytestmark = pytest.mark.slow


def shoot(browser: WebDriver, name: str) -> None:
    assert browser.get_screenshot_as_png().startswith(b"\x89PNG")
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(Path(SCREENSHOTS) / f"{name}.png"))


def fits(browser: WebDriver) -> bool:
    """The page needs no sideways scrolling (a wide table scrolls in its own box)."""
    return bool(
        browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    )


def click(browser: WebDriver, label: str) -> None:
    """Press the button labelled `label` and wait for the page it loads."""
    (button,) = [
        b for b in browser.find_elements(By.CSS_SELECTOR, "main button") if b.text == label
    ]
    button.click()
    WebDriverWait(browser, 30).until(lambda b: _gone(button))


def follow(browser: WebDriver, text: str) -> None:
    """Follow the link reading `text` and wait for the page it loads."""
    link = browser.find_element(By.LINK_TEXT, text)
    link.click()
    WebDriverWait(browser, 30).until(lambda b: _gone(link))


def delivered(browser: WebDriver) -> bool:
    """Reload the trace; whether its outbox row is delivered."""
    browser.refresh()
    return "delivered" in browser.find_element(By.ID, "outbox").text


def _gone(element: WebElement) -> bool:
    try:
        element.is_enabled()
    except StaleElementReferenceException:
        return True
    return False


def test_an_operator_fixes_a_mismatched_payment_from_the_console(
    settings: Settings,
    conn: psycopg.Connection[Row],
    redis_conn: Redis,
    factory: Factory,
    tmp_path: Path,
    browser: WebDriver,
) -> None:
    with Receiver(tmp_path / "receiver") as receiver:
        shop = factory.shop(fulfilment_url=receiver.url)
        order_id = factory.order(shop, merchant_reference="INV-2041", amount=1999)
        env = process_env(settings, PAYHOOK_DASHBOARD_PASSWORD=PASSWORD, **LOCAL_RECEIVER_SETTINGS)
        port = free_port()
        processes = [
            start(["consumer"], env, tmp_path / "consumer.log"),
            start(["outbox-worker"], env, tmp_path / "outbox.log"),
            start(["dashboard", "--port", str(port)], env, tmp_path / "dashboard.log"),
        ]
        try:
            # The gateway charged 25.00 for an order of 19.99.
            event = StandardEvent(merchant_reference="INV-2041", amount=2500)
            queue = events_queue(redis_conn, settings)
            enqueue_event(queue, factory.standard_envelope(shop, event), settings)
            wait_until(
                lambda: factory.count("payment_exceptions", event_id=event.event_id) == 1,
                60,
                "the mismatch to be recorded",
            )
            base = f"http://127.0.0.1:{port}"
            wait_until(lambda: _answers(f"{base}/healthz"), 30, "the dashboard")
            browser.get(f"http://{USER}:{PASSWORD}@127.0.0.1:{port}/console/exceptions")

            # The exceptions page lists it; its event opens the trace.
            assert "amount_mismatch" in browser.find_element(By.TAG_NAME, "tbody").text
            shoot(browser, "exceptions")
            follow(browser, event.event_id)
            exception = browser.find_element(By.CSS_SELECTOR, "[id^=exception-]")
            assert "expected\n1999" in exception.text and "received\n2500" in exception.text
            shoot(browser, "trace-mismatch")

            # A dry run: the same decision, nothing written.
            click(browser, "Dry run")
            decision = browser.find_element(By.ID, "decision").text
            assert "Nothing was written" in decision and "amount_mismatch" in decision
            assert factory.order_state(shop, order_id) == "pending"

            # The merchant's system corrects the order; the dry run now applies it.
            conn.execute(
                "UPDATE payhook.payment_orders SET amount_minor = 2500 WHERE id = %s", (order_id,)
            )
            follow(browser, event.event_id)
            click(browser, "Dry run")
            decision = browser.find_element(By.ID, "decision").text
            assert "pending → paid" in decision and "fulfil_order" in decision
            assert factory.count("payment_outbox", event_id=event.event_id) == 0
            shoot(browser, "dry-run")

            click(browser, "Replay now")
            assert "Decided and written" in browser.find_element(By.ID, "decision").text
            assert factory.order_state(shop, order_id) == "paid"

            # The trace shows the transition, the delivered fulfilment and who did what.
            follow(browser, event.event_id)
            WebDriverWait(browser, 60, poll_frequency=0.5).until(delivered)
            assert "pending → paid" in browser.find_element(By.ID, "transitions").text
            actions = browser.find_element(By.ID, "operator-actions").text
            assert actions.count(f"by {USER} (dashboard)") == 3
            assert "exception_replay" in actions
            shoot(browser, "trace-delivered")
            (delivery,) = [r for r in receiver.requests() if event.event_id in r["body"]]
            assert order_id in delivery["body"]
            assert factory.count("payment_outbox", event_id=event.event_id) == 1

            # Every other page, and the orders search from the trace.
            follow(browser, "INV-2041")
            assert "paid" in browser.find_element(By.TAG_NAME, "main").text
            shoot(browser, "orders")
            for name in ("anomalies", "outbox", "reconcile"):
                browser.get(f"{base}/console/{name}")
                assert browser.find_element(By.TAG_NAME, "h1").text
                shoot(browser, name)

            # On a phone's window the pages need no sideways scrolling.
            browser.set_window_size(*PHONE)
            for path in ("/console/exceptions?state=all", "/console/orders?q=INV-2041"):
                browser.get(base + path)
                assert fits(browser), path
            browser.get(f"{base}/console/trace?tenant={shop.tenant_id}&event={event.event_id}")
            assert fits(browser)
            shoot(browser, "trace-phone")
        finally:
            for process in processes:
                stop(process)
