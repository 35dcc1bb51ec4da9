class QRoot: pass
def newton_schulz(): pass
def ns_coefficients(): pass
