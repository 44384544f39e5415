"""Keeping training alive when nodes fail, leave or return (issue #32)."""
