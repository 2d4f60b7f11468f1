"""kvtier.configs"""
