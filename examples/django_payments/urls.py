"""The example's routes: the same payment API as a plain view, a DRF view and an async view."""

from __future__ import annotations

from django.urls import path

from examples.django_payments.payments import views

urlpatterns = [
    path("payments", views.create_payment),
    path("payments/<int:payment_id>", views.get_payment),
    path("drf/payments", views.PaymentList.as_view()),
    path("async/payments", views.create_payment_async),
    path("health", views.health),
]
