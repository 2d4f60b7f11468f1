"""kvtier.connector"""
