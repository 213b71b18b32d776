"""backends/generation"""
