"""Byte units, in one place: MiB and GiB are powers of two everywhere in pipesim.

A leaf module (it imports nothing), so both shared vocabularies may use it.
"""

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
