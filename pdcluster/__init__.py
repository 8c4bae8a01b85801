"""Shared parts of pdcluster: the typed protocol, the worker launcher and the local cluster."""
