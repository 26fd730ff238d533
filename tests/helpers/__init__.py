"""Test helpers shared by more than one test folder (imported, never conftest)."""
