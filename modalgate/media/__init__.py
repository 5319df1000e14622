"""Bytes: data URLs, base64, magic-byte sniffing, address rules (fetching and decoding later)."""
