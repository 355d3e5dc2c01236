"""Cross-validated logistic regression on scikit-learn's breast-cancer set:
one point per regularisation strength C."""
from sklearn.datasets import load_breast_cancer
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

X, y = load_breast_cancer(return_X_y=True)


def process(C):
    model = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=1000))
    return {"C": C, "accuracy": float(cross_val_score(model, X, y, cv=5).mean())}
