"""The page on a phone (390x844): every tab within reach without a menu, a run's figures within the
screen's width, and the banner never covered by a loading message."""
import pytest
from browser import HANG_GUARD_MS, generate, open_tab, skip_without_browser

skip_without_browser()

PHONE = {"width": 390, "height": 844}
# Each tab of the page and the button it is used by.
MAIN_BUTTONS = {"Voice clone": "#clone-generate", "Custom voice": "#custom-generate", "Voice design": "#design-generate",
                "Omni chat": "#omni-generate", "Listening test": "#listen-start"}
# The tabs whose first opening loads a model, and the line that says when it is ready.
MODEL_STATUS = {"Custom voice": "#custom-model-status", "Voice design": "#design-model-status", "Omni chat": "#omni-model-status"}
# Records every loading message shown over the banner, from the page's first script on.
WATCH_BANNER = """
window.bannerCovers = [];
new MutationObserver(() => {
    for (const tracker of document.querySelectorAll('#banner [data-testid=status-tracker]:not(.hide)')) {
        window.bannerCovers.push(tracker.innerText.trim() || tracker.className);
    }
}).observe(document, {subtree: true, childList: true, attributes: true, attributeFilter: ['class']});
"""
# For each element: how far it reaches past the right edge of the screen, and how much of its content
# is scrolled sideways out of it (it and the scrolling boxes inside it); 0 and 0 when it fits.
OVERFLOW = """(selector) => {
    const element = document.querySelector(selector);
    const scrollers = [element, ...element.querySelectorAll('*')].filter(e =>
        e.clientWidth > 0 && (e === element || ['auto', 'scroll'].includes(getComputedStyle(e).overflowX)));
    return {past_edge: Math.max(0, Math.round(element.getBoundingClientRect().right - window.innerWidth)),
            hidden_sideways: Math.max(0, ...scrollers.map(e => e.scrollWidth - e.clientWidth))};
}"""


@pytest.fixture()
def phone(browser, app_url):
    page = browser.new_page(viewport=PHONE)
    page.set_default_timeout(HANG_GUARD_MS)
    page.add_init_script(WATCH_BANNER)
    page.goto(app_url)
    page.wait_for_selector("#clone-generate")
    yield page
    page.close()


def in_view_across(page, locator) -> bool:
    box = locator.bounding_box()
    return box is not None and box["x"] >= 0 and box["x"] + box["width"] <= page.viewport_size["width"]


def test_every_tab_is_reachable_on_a_phone_without_a_menu(phone):
    for label, button in MAIN_BUTTONS.items():
        tab = phone.get_by_role("tab", name=label, exact=True)
        assert tab.count() == 1, f"{label} is not in the tab bar"
        tab.scroll_into_view_if_needed()
        assert tab.is_visible() and in_view_across(phone, tab), label
        tab.click()
        main = phone.locator(button)
        main.scroll_into_view_if_needed()
        assert main.is_visible() and in_view_across(phone, main), label
    more = phone.get_by_role("button", name="More tabs")
    assert more.count() == 0 or not more.is_visible()


def test_the_banner_is_never_covered_by_a_loading_message(phone):
    phone.wait_for_function("() => /^Ready/.test(document.querySelector('#clone-model-status').innerText)")
    for label, status in MODEL_STATUS.items():
        phone.get_by_role("tab", name=label, exact=True).click()
        phone.wait_for_function("(status) => /^Ready/.test(document.querySelector(status).innerText)", arg=status)
    assert phone.locator("#banner").is_visible()
    assert phone.evaluate("() => window.bannerCovers") == []


def test_a_run_on_a_phone_fits_the_screen_width(phone):
    open_tab(phone, "custom")
    run = generate(phone, "custom")
    assert run["rows"] == run["chunks"] > 0
    for selector in ("#custom-player", "#custom-summary", "#custom-take", "#custom-table"):
        phone.locator(selector).scroll_into_view_if_needed()
        assert phone.evaluate(OVERFLOW, selector) == {"past_edge": 0, "hidden_sideways": 0}, selector
    assert phone.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
