"""Viewers tier: our files (timelines, report pages) loaded by programs that are not ours, a Chromium and
Chrome DevTools' trace model under node, as users open them. Each test skips, saying what to install, where
its program is absent; .ci/run installs both, so in CI they run."""
