"""Cross-validated SVM on scikit-learn's digits: one point per (C, gamma)."""
from sklearn.datasets import load_digits
from sklearn.model_selection import cross_val_score
from sklearn.svm import SVC

X, y = load_digits(return_X_y=True)


def process(C, gamma):
    scores = cross_val_score(SVC(C=C, gamma=gamma), X, y, cv=3)
    return {"C": C, "gamma": gamma, "accuracy": float(scores.mean())}
