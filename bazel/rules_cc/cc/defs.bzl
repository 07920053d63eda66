"""Offline stand-in for @rules_cc//cc:defs.bzl on Bazel 4.2.3.

@bazel_tools loads these seven names from rules_cc even when a workspace
builds no C++. Each one forwards to the rule built into Bazel 4.2.3, as the
real rules_cc of that era did. Debian's bazel-rules-cc (0.0.4) cannot be used
instead: it loads `use_cpp_toolchain`, which Bazel 4.2.3 lacks.
"""

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)
