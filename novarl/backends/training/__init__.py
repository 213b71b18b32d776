"""backends/training"""
