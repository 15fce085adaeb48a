"""Bridges to external training frameworks (each in its own subpackage, imported only when used)."""
