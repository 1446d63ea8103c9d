"""Ledger stores: one LedgerStore protocol (core.ledger), one adapter per backend."""
