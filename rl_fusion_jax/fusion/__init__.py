"""Deployment modes: how actor, reference and reward models share (or split) the devices."""
