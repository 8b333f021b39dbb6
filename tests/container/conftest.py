"""What the container tests measured (build time, size, start and stop times), printed at the
end of every run, CI's included: docs/image.md quotes these numbers."""

MEASURED: list[str] = []


def pytest_terminal_summary(terminalreporter):
    if MEASURED:
        terminalreporter.section("container image")
        for line in MEASURED:
            terminalreporter.write_line(line)
