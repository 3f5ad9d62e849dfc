"""Fixtures of the object-storage tests: a real S3 server (moto, a process) and a fresh bucket per test."""

from tests.s3_cases import bucket, s3_server  # noqa: F401 - fixtures for tests/runtime/test_storage*.py
