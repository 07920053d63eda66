#!/bin/sh
# Offline stand-in: the real coverage report generator is downloaded by Bazel,
# which these machines cannot do.
echo "coverage_report_generator: coverage reports are unavailable in this" \
  "offline Bazel set-up (see bazel/README.md); use 'bazel test' instead." >&2
exit 1
